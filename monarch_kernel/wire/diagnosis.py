"""Messages of hang diagnosis: asking ranks where they are, their answers, and a stop that had to
end collectives in progress (see rank/collectives.py). A rank's reader thread answers them,
whatever its main thread does."""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.core.hangs import RankReport
from monarch_kernel.wire.message_pickling import fast_pickling


@dataclass(frozen=True)
class InspectRanks:
    """Controller -> agent -> ranks: say where you are (stacks, collective progress)."""

    ranks: tuple[int, ...]
    inspect_id: int
    all_threads: bool = False
    stacks_only: bool = False  # no collective figures (a profile's samples, many a second)
    counters_only: bool = False  # the groups' counters, not the recorder's entries (a running cell's regular look)


@dataclass(frozen=True)
class RankInspection:
    """A rank -> agent -> controller: the answer to an InspectRanks."""

    inspect_id: int
    rank: int
    report: RankReport


@dataclass(frozen=True)
class CollectivesAborted:
    """A rank -> controller (on the request's lane, or through the agent): a stop found the rank
    inside a collective in request `req_id` and ends it there (`what` is done); the process groups
    are broken on every rank until they are made anew. Sent before the request's result."""

    req_id: int
    rank: int
    what: str


fast_pickling(vars().values(), __name__)
