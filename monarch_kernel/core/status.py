"""The states a rank can be in, as the controller, the views and the sidebar name them."""

from __future__ import annotations

import enum


class RankStatus(enum.StrEnum):
    """What a rank is doing, as last reported."""

    STARTING = "starting"  # forked, not ready yet
    IDLE = "idle"
    BUSY = "busy"  # running a cell, a push or pull, or an actor endpoint
    UNRESPONSIVE = "unresponsive"  # alive but not answering heartbeats (SIGSTOP, stuck in native code)
    DEAD = "dead"  # exited, was killed, or its host was lost


SHORT_TIME_NOTE = "less than 10 minutes left"  # in an allocation's status line: views draw it as a warning


def allocation_is_short(line: str | None) -> bool:
    """Whether an allocation's status line warns that its time is nearly up."""
    return bool(line) and SHORT_TIME_NOTE in str(line)
