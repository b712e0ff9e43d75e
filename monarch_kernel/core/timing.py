"""How long each rank took for one request or actor call: the record every view and history share."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class RankTiming(NamedTuple):
    """One rank's part of a request or call: seconds None if it died; ok False if it failed."""

    rank: int
    seconds: float | None
    ok: bool


TimingReporter = Callable[[str, list[RankTiming]], None]  # (title, timings): shows them, where someone does
