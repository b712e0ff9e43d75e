"""Helpers shared by the benchmarks."""

from __future__ import annotations

import time


def timed(fn, n: int, warmup: int = 1) -> list[float]:
    """Seconds per call of fn, n times after warmup calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


class NullSink:
    """An output sink that discards everything (to time the transport, not the view)."""

    def output(self, *a): pass
    def display(self, *a): pass
    def notice(self, *a): pass
    def rank_done(self, *a): pass
    def tick(self): pass
    def close(self): pass
