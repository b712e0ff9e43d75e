"""`%mesh profile --seconds S`: where the time goes on a running mesh, from its ranks' Python stacks
sampled many times a second (each rank's reader thread answers; the main thread is not stopped),
as a flame table per group of ranks that spend their time alike."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.core.hangs import RankReport
from monarch_kernel.core.ranksets import format_ranks

SAMPLES_PER_S = 10
SHOWN_ROWS = 12


class FlameTable:
    """Per group of ranks: the share of samples each code path (outermost first) was on the stack."""

    def __init__(self, groups: list[tuple[tuple[int, ...], list[tuple[str, int, float]]]], samples: int, seconds: float):
        self.groups = groups  # (ranks, [(frame text, depth, share of samples)])
        self.samples = samples
        self.seconds = seconds

    def text(self) -> str:
        """The table as text: one block per group of ranks, frames indented by depth."""
        lines = [f"{self.samples} samples of each rank over {self.seconds:.1f} s"]
        for ranks, rows in self.groups:
            lines.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(list(ranks))}")
            lines += [f"  {share * 100:5.1f}%  {'  ' * depth}{frame}" for frame, depth, share in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())


def sample(runtime: MeshRuntime, ranks: tuple[int, ...], seconds: float) -> FlameTable:
    """Sample the ranks' stacks for `seconds`; their flame table."""
    paths: dict[int, Counter[tuple[str, ...]]] = {r: Counter() for r in ranks}
    taken = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        reports, _, _ = runtime.inspections.ask(ranks, stacks_only=True, timeout=0.5)
        for rank, report in reports.items():
            paths[rank][_path(report)] += 1
        taken += 1
        time.sleep(max(0.0, 1 / SAMPLES_PER_S - (time.monotonic() - started)))
    return FlameTable(_grouped(paths, taken), taken, seconds)


def _path(report: RankReport) -> tuple[str, ...]:
    """The user's frames of the main thread, outermost first (or what the rank does instead)."""
    frames = tuple(f.text() for f in report.stack if f.user)
    return frames or (f"(running {report.running}, in library code)" if report.running else "(idle)",)


def _grouped(paths: dict[int, Counter[tuple[str, ...]]], taken: int,
             ) -> list[tuple[tuple[int, ...], list[tuple[str, int, float]]]]:
    """Ranks whose rows are the same (to the percent) share a block."""
    blocks: dict[tuple[tuple[str, int, int], ...], list[int]] = {}
    rows_of: dict[tuple[tuple[str, int, int], ...], list[tuple[str, int, float]]] = {}
    for rank, counted in sorted(paths.items()):
        rows = _rows(counted, taken)
        key = tuple((frame, depth, round(share * 100)) for frame, depth, share in rows)
        blocks.setdefault(key, []).append(rank)
        rows_of[key] = rows
    return [(tuple(ranks), rows_of[key]) for key, ranks in blocks.items()]


def _rows(counted: Counter[tuple[str, ...]], taken: int) -> list[tuple[str, int, float]]:
    """Inclusive shares of each path prefix, as a tree (children after their parent, heaviest first)."""
    inclusive: Counter[tuple[str, ...]] = Counter()
    for path, n in counted.items():
        for depth in range(1, len(path) + 1):
            inclusive[path[:depth]] += n
    rows: list[tuple[str, int, float]] = []

    def visit(prefix: tuple[str, ...]) -> None:
        children = sorted((p for p in inclusive if len(p) == len(prefix) + 1 and p[:len(prefix)] == prefix),
                          key=lambda p: -inclusive[p])
        for child in children:
            if len(rows) < SHOWN_ROWS:
                rows.append((child[-1], len(prefix), inclusive[child] / max(1, taken)))
                visit(child)

    visit(())
    return rows
