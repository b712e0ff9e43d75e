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
