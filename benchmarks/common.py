"""Helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


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


def timed_together(fns: dict, n: int, rounds: int = 10, warmup: int = 20) -> dict[str, list[float]]:
    """Seconds per call of each fn, taken in alternating blocks (n in all for each), so that
    the machine's drift during the run weighs on every row alike."""
    for fn in fns.values():
        timed(fn, 0, warmup)
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name] += timed(fn, max(1, n // rounds), 0)
    return out


class NullSink:
    """An output sink that discards everything (to time the transport, not the view)."""

    def output(self, *a): pass
    def display(self, *a): pass
    def notice(self, *a): pass
    def rank_done(self, *a): pass
    def tick(self): pass
    def close(self): pass


class GroupingSink(NullSink):
    """Groups lines as the notebook view does and renders the final text (`.text`), so a row
    that prints includes the grouping."""

    def __init__(self, ranks):
        from monarch_kernel.views.output import OutputGroups

        self.model = OutputGroups(ranks)

    def output(self, rank, stream, text):
        self.model.add(rank, stream, text)

    def close(self):
        from monarch_kernel.views.output import render_text

        self.model.finish()
        self.text = render_text(self.model)


MONARCH_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "monarch-venv",
                              "bin", "python")


def run_system(script: str, name: str, quick: bool) -> dict:
    """Run one system's benchmark (`script --child name`) in a fresh interpreter.

    Returns its timings (the last JSON line it printed) or {"skipped": reason}.
    """
    python = sys.executable
    if name == "monarch" and os.path.exists(MONARCH_PYTHON):  # the pinned torchmonarch the conformance suite uses
        python = MONARCH_PYTHON
    cmd = [python, script, "--child", name] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"skipped": " | ".join(tail) or f"exit code {proc.returncode}"}


def format_seconds(seconds: float) -> str:
    """1.23 s or 4.56 ms."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def figure(seconds: float, row: str, *, per_run: int = 1, counted: str = "", nbytes: int = 64 << 20) -> str:
    """How a row's median reads: calls per second for `counted` rows, GB/s for 64 MiB rows, else time."""
    if counted and row.startswith(counted):
        return f"{per_run / seconds:,.0f}/s"
    if "64 MiB" in row:
        return f"{(nbytes / seconds) / 1e9:.2f} GB/s"
    return format_seconds(seconds)


def report(results: dict, rows: list[str], title: str, fmt: Callable[[float, str], str]) -> str:
    """The comparison table: median (p99) per system, and ours relative to each peer.

    The first system in `results` is ours; ratios are our median time over the peer's.
    """
    names = list(results)
    lines = [f"{title:34}" + "".join(f"{n:>26}" for n in names) + "   ours vs peers"]
    for row in rows:
        cells, medians = [], {}
        for name in names:
            data = results[name].get(row)
            if not data:
                cells.append(f"{'-':>26}")
                continue
            med = statistics.median(data)
            p99 = sorted(data)[min(len(data) - 1, int(len(data) * 0.99))]
            medians[name] = med
            text = fmt(med, row) + (f" (p99 {fmt(p99, row)})" if len(data) >= 10 else "")
            cells.append(f"{text:>26}")
        ratios = [f"{peer} {medians[names[0]] / medians[peer]:.2f}x time"
                  for peer in names[1:] if names[0] in medians and peer in medians]
        lines.append(f"{row:34}" + "".join(cells) + "   " + ", ".join(ratios))
    for name in names:
        if "skipped" in results[name]:
            lines.append(f"{name} skipped: {results[name]['skipped']}")
    return "\n".join(lines)


def benchmark_main(script: str, systems: dict[str, Callable[[bool], dict]], rows: list[str], title: str,
                   fmt: Callable[[float, str], str], footnote: str) -> None:
    """The command line of a benchmark: `--child NAME` measures one system, else all in turn."""
    import argparse
    import os

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", default=",".join(systems))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(systems[args.child](args.quick)), flush=True)
        os._exit(0)  # do not wait on peers' lingering threads
    results = {}
    for name in args.only.split(","):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run_system(script, name, args.quick)
    print(report(results, rows, title, fmt))
    print("\n" + footnote)


def cross_mesh_times(api: Any, procs_a: Any, procs_b: Any, calls: int, repeats: int) -> list[float]:
    """Per-call times of an async endpoint of an actor on `procs_a` awaiting `calls` calls to an actor on
    `procs_b` (Monarch's ping-pong between proc meshes, each with a dim `gpus`), with Monarch's API module
    `api` (ours or theirs)."""

    class Pong(api.Actor):
        @api.endpoint
        async def ping(self, x: int) -> int:
            return x

    class Ping(api.Actor):
        def __init__(self, pong: Any):
            self.pong = pong.slice(gpus=0)

        @api.endpoint
        async def relay(self, count: int) -> None:
            for i in range(count):
                await self.pong.ping.call_one(i)

    pong = procs_b.spawn("pong", Pong)
    ping = procs_a.spawn("ping", Ping, pong)
    one = ping.slice(gpus=0)
    one.relay.call_one(10).get()
    return [t / calls for t in timed(lambda: one.relay.call_one(calls).get(), repeats, 1)]
