"""Events from the controller's loop to the thread waiting on a request (frozen, typed).

What ranks send about a request travels on as the wire message itself (`Output`,
`Display`, `InputRequest`); the controller adds its own news below. The loop puts them
on the request's queue as they arrive; `MeshFuture` takes them off on the waiting thread
and hands them to the run's output sink.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.wire.messages import Display, InputRequest, Output


@dataclass(frozen=True)
class NoticeEvent:
    """News about a rank: it died, or stopped answering heartbeats."""

    rank: int
    text: str


@dataclass(frozen=True)
class RanksDoneEvent:
    """These ranks finished the request (others still run)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class DoneEvent:
    """Every rank finished or failed: the request is complete."""


RequestEvent = Output | Display | InputRequest | NoticeEvent | RanksDoneEvent | DoneEvent
