"""Events from the controller's loop to the thread waiting on a request (frozen, typed).

The loop puts them on the request's queue as messages arrive; `MeshFuture` takes them
off on the waiting thread and hands them to the run's output sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OutputEvent:
    """Text a rank printed."""

    rank: int
    stream: str
    text: str


@dataclass(frozen=True)
class DisplayEvent:
    """A rich display made on a rank."""

    rank: int
    data: dict[str, Any]
    metadata: dict[str, Any]


@dataclass(frozen=True)
class NoticeEvent:
    """News about a rank: it died, or stopped answering heartbeats."""

    rank: int
    text: str


@dataclass(frozen=True)
class InputEvent:
    """A rank called input() (or getpass, or pdb): the notebook should ask for a line."""

    rank: int
    prompt: str
    password: bool


@dataclass(frozen=True)
class RanksDoneEvent:
    """These ranks finished the request (others still run)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class DoneEvent:
    """Every rank finished or failed: the request is complete."""


RequestEvent = OutputEvent | DisplayEvent | NoticeEvent | InputEvent | RanksDoneEvent | DoneEvent
