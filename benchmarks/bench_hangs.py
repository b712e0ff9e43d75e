"""Hang diagnosis: what collective tracking costs, and how long stacks of many ranks take.

1. Tracking overhead: a loop of 1,000 small `all_reduce`s on a 4-rank gloo mesh with torch's
   flight recorder on (the default, which the verdicts read) and off (`TORCH_FR_BUFFER_SIZE=0`),
   the two meshes taken in turn, several rounds, in the same run. With the recorder off, `why()`
   says it has no collective figures (checked).
2. Stacks of every rank (`mesh.stacks()`, each rank's reader thread answering) on meshes of SSH
   test hosts in network namespaces (needs root): 1 x 4, 8 x 4 and 32 x 4 light ranks (128),
   and 8 x 128 (1,024: the simulated thousand), the median of a few calls each.

    .venv/bin/python benchmarks/bench_hangs.py [--quick] [--only overhead|stacks]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import NullSink, format_seconds  # noqa: E402

LOOP = ("import torch, torch.distributed as dist, time\nt = torch.ones(4)\nstarted = time.perf_counter()\n"
        "for _ in range(1000):\n    dist.all_reduce(t)\ntime.perf_counter() - started")


def overhead(rounds: int) -> dict[str, list[float]]:
    import monarch_kernel

    meshes = {
        "as shipped: flight recorder on, ranks' status read at each heartbeat":
            monarch_kernel.local_mesh(gpus=4, dist="gloo", name="tracked"),
        "our status reading off (MONARCH_KERNEL_COLLECTIVE_STATUS=off)":
            monarch_kernel.local_mesh(gpus=4, dist="gloo", name="untracked",
                                      env={"MONARCH_KERNEL_COLLECTIVE_STATUS": "off"}),
        "torch's flight recorder off too (TORCH_FR_BUFFER_SIZE=0)":
            monarch_kernel.local_mesh(gpus=4, dist="gloo", name="fr-off",
                                      env={"MONARCH_KERNEL_COLLECTIVE_STATUS": "off", "TORCH_FR_BUFFER_SIZE": "0"}),
    }
    times: dict[str, list[float]] = {name: [] for name in meshes}
    try:
        for mesh in meshes.values():
            mesh.run(LOOP, sink=NullSink())  # warm-up
        for _ in range(rounds):
            for name, mesh in meshes.items():
                times[name].append(max(mesh.run(LOOP, sink=NullSink()).values()))
        off = meshes["torch's flight recorder off too (TORCH_FR_BUFFER_SIZE=0)"]
        said = str(off.why())
        assert "idle" in said, said  # (idle: no figures needed; the verdict degrades, it does not fail)
    finally:
        for mesh in meshes.values():
            mesh.shutdown()
    return times


def stacks(shapes: list[tuple[int, int]], calls: int) -> dict[str, float]:
    from bench_scale import our_pids, start, wait_for
    from sshhosts import SSHTestHosts
    from sshhosts import unavailable_reason as no_ssh

    if no_ssh():
        sys.exit(f"cannot build the test hosts here: {no_ssh()}")
    most = max(h for h, _ in shapes)
    hosts = SSHTestHosts(most, tempfile.mkdtemp(prefix="stacks-"), client_alive=(5, 3))
    out: dict[str, float] = {}
    try:
        hosts.start()
        for count, ranks in shapes:
            mesh = start(hosts, count, ranks, 1 << 30, f"stacks{count}x{ranks}")
            try:
                mesh.run("pass", sink=NullSink())
                views = {f"{count} hosts x {ranks} ranks, all {count * ranks}": mesh}
                if count * ranks > 128:  # the simulated thousand: 128 of its ranks, 16 on each host
                    views[f"{count} hosts x {ranks} ranks, 128 of them"] = mesh.slice(gpus=slice(0, 128 // count))
                for name, view in views.items():
                    view.stacks(timeout=30)  # warm-up
                    taken = []
                    for _ in range(calls):
                        t = time.perf_counter()
                        found = view.stacks(timeout=30)
                        taken.append(time.perf_counter() - t)
                        assert len(found.reports) == len(view.ranks), f"{len(found.reports)} of {len(view.ranks)}"
                    out[name] = statistics.median(taken)
            finally:
                mesh.shutdown()
                wait_for(lambda chosen=hosts.hosts[:count]: not our_pids(hosts, chosen), 60, "every process ending")
    finally:
        hosts.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["overhead", "stacks"], default=None)
    args = parser.parse_args()
    if args.only in (None, "overhead"):
        times = overhead(3 if args.quick else 9)
        shipped, ours_off, fr_off = (statistics.median(v) for v in times.values())
        print("1,000 small all_reduces on 4 gloo ranks (the slowest rank's loop; median of the rounds, taken in turn)")
        print("| | seconds per loop | ratio to the last row |\n|---|---|---|")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values):.3f} s | {statistics.median(values) / fr_off:.3f} |")
        print(f"\nour collective tracking (status at each heartbeat): {100 * (shipped / ours_off - 1):+.1f}% "
              f"(target: within 3%); torch's flight recorder itself: {100 * (ours_off / fr_off - 1):+.1f}%\n")
    if args.only in (None, "stacks"):
        shapes = [(1, 4), (8, 4), (32, 4)] + ([] if args.quick else [(8, 128)])
        found = stacks(shapes, 3 if args.quick else 5)
        print("mesh.stacks() (every rank's stack, from its reader thread; median)")
        print("| mesh | time |\n|---|---|")
        for name, seconds in found.items():
            print(f"| {name} | {format_seconds(seconds)} |")


if __name__ == "__main__":
    main()
