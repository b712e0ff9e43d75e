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


def compact_ranks(ranks: Iterable[int], among: Iterable[int] = ()) -> str:
    """The shortest way to name a rank set: `0-127`, `0-63,65-127`, `all but 3,17` (of `among`),
    or a stride, `0-126 step 2`."""
    ordered = sorted(set(ranks))
    options = [format_ranks(ordered)]
    rest = sorted(set(among) - set(ordered))
    if rest and len(ordered) > len(rest):
        options.append(f"all but {format_ranks(rest)}")
    if len(ordered) >= 4:
        step = ordered[1] - ordered[0]
        if step > 1 and all(b - a == step for a, b in zip(ordered, ordered[1:])):
            options.append(f"{ordered[0]}-{ordered[-1]} step {step}")
    return min(options, key=len)


def rank_label(host: str, local_rank: int, rank: int) -> str:
    """How every view names a rank: `host:gpu (rank r)`."""
    return f"{host}:{local_rank} (rank {rank})"
