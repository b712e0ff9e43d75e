"""Rank sets as people read them: [0, 1, 2, 3, 5] is "0-3,5"."""

from __future__ import annotations

from collections.abc import Iterable


def format_ranks(ranks: Iterable[int]) -> str:
    """Compact rank-set text: [0, 1, 2, 3, 5] -> '0-3,5'."""
    ordered = sorted(set(ranks))
    if not ordered:
        return ""
    runs: list[str] = []
    start = prev = ordered[0]
    for r in ordered[1:]:
        if r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    runs.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(runs)


def rank_label(host: str, local_rank: int, rank: int) -> str:
    """How every view names a rank: `host:gpu (rank r)`."""
    return f"{host}:{local_rank} (rank {rank})"
