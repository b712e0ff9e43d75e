"""`%%mesh --profile [DIR]`: one cell under torch.profiler on every rank, written as one Chrome/Perfetto
trace (a process per rank, the ranks' clocks lined up by their measured offsets to the notebook's),
and a table of the top operations with the slowest rank of each."""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.texttable import text_table
from monarch_kernel.wire.ops import ProfileTrace, ReadClock, StartProfile, StopProfile

T = TypeVar("T")
CLOCK_ROUNDS = 5
SHOWN_OPERATIONS = 10


@dataclass
class ProfileReport:
    """Where the merged trace was written, and the top operations (name, calls, total ms, slowest rank, its ms)."""

    path: str
    ranks: tuple[int, ...]
    offsets_us: dict[int, float]
    top: list[tuple[str, int, float, int, float]] = field(default_factory=list)

    def text(self) -> str:
        """The path, then the table."""
        rows = [("operation", "calls", "total ms", "slowest rank", "its ms")]
        rows += [(name, str(calls), f"{total / 1000:.2f}", str(rank), f"{own / 1000:.2f}")
                 for name, calls, total, rank, own in self.top]
        return (f"profile of ranks {format_ranks(list(self.ranks))} written to {self.path} "
                "(open it in https://ui.perfetto.dev or chrome://tracing)\n" + "\n".join(text_table(rows)))

    def __str__(self) -> str:
        return self.text()


def clock_offsets(ask: Callable[[Any], dict[int, Any]]) -> dict[int, float]:
    """Each rank's clock minus the notebook's, in microseconds: the reading of the round trip that
    took least, taken as made half-way through it (as NTP does)."""
    best: dict[int, tuple[float, float]] = {}
    for _ in range(CLOCK_ROUNDS):
        sent = time.time_ns() / 1000
        readings = ask(ReadClock())
        back = time.time_ns() / 1000
        for rank, reading in readings.items():
            if rank not in best or back - sent < best[rank][0]:
                best[rank] = (back - sent, float(reading) - (sent + back) / 2)
    return {rank: offset for rank, (_, offset) in best.items()}


def profiled(ask: Callable[[Any], dict[int, Any]], run: Callable[[], T], folder: str, label: str,
             show: Callable[[str], None]) -> T:
    """run() with every rank profiled; the merged trace goes to `folder` and its table to show()."""
    offsets = clock_offsets(ask)
    ask(StartProfile())
    try:
        return run()
    finally:
        report = write_trace(ask(StopProfile()), offsets, folder, label)
        show(report.text())


def write_trace(answers: dict[int, ProfileTrace], offsets: dict[int, float], folder: str,
                label: str) -> ProfileReport:
    """Merge the ranks' traces into one file (gzip JSON) in `folder`; its report."""
    starts = {rank: a.base_us - offsets.get(rank, 0.0) for rank, a in answers.items()}
    origin = min(starts.values(), default=0.0)
    events: list[dict[str, Any]] = []
    for rank, answer in sorted(answers.items()):
        shift = starts[rank] - origin
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for event in answer.events:
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue  # (the rank's own: "python"; ours name it by rank)
            event = dict(event, pid=rank)
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift
            events.append(event)
    os.makedirs(folder, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in label) or "cell"
    path = os.path.abspath(os.path.join(folder, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.trace.json.gz"))
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "metadata": {"monarch_kernel": {"clock_offsets_us": offsets, "cell": label}}}, f)
    return ProfileReport(path, tuple(sorted(answers)), offsets, top_operations(answers))


def top_operations(answers: dict[int, ProfileTrace]) -> list[tuple[str, int, float, int, float]]:
    """The operations that took most self time over all ranks, each with the rank it took longest on."""
    total: dict[str, list[Any]] = {}
    for rank, answer in answers.items():
        for name, calls, self_us in answer.ops:
            entry = total.setdefault(name, [0, 0.0, rank, -1.0])
            entry[0] += calls
            entry[1] += self_us
            if self_us > entry[3]:
                entry[2], entry[3] = rank, self_us
    ranked = sorted(total.items(), key=lambda item: -item[1][1])[:SHOWN_OPERATIONS]
    return [(name, calls, spent, rank, own) for name, (calls, spent, rank, own) in ranked]
