"""Scale harness: meshes of 1 to 32 SSH hosts x 4 ranks on network-namespace test hosts (needs root).

Every host is a network namespace with its own OpenSSH sshd (tests/sshhosts.py), so each
agent is a real SSH session; ranks start light (dist="none", nothing preloaded), so 32
agents and 128 ranks fit on a small machine. For each mesh size, in one run:

- ready: from `ssh_mesh(...)` to every rank ready, and the controller's CPU meanwhile (the rest
  of the start is each host's own work: sshd, the agent's start, forking its ranks);
- no-op broadcast (median) and the controller's CPU per broadcast (this process, every thread);
- 1,000 printed lines per rank until the cell returns with all of them grouped;
- the longest `mesh.status()` call while every rank prints (is the notebook side still responsive?);
- push of 16 MiB (`--push-mib`) to all hosts;
- a rank killed (SIGKILL) until the mesh reports it dead;
- a host's link cut until the mesh reports its ranks lost (a leaf of the relay tree), and,
  where there are relays, a relay host's link cut until its whole subtree is reported lost
  (the other hosts must still answer);
- `down` until no process of ours is left on any host.

Fan-out through relays (`relay_branching`): each mesh size is also started with every
branching in --branchings (default: direct, i.e. no relays, 4, and 16, the default) and
measured for ready, no-op broadcast, controller CPU per broadcast and the copies of a push
that leave the controller (bytes sent / push size), all in the same run. These meshes have
--fan-ranks ranks per host (default 1), so that what grows with hosts is not hidden by what
grows with ranks (the controller books each rank's result: about 20 us per rank here).

The table is printed (hosts across) and written with a plot of each row against the
number of hosts to --out (default artifacts/): bench_scale.md and bench_scale.png.
This machine has 2 cores for all hosts at once, so growth here is CPU contention as much
as protocol; the shape of the curves is the point. Past 4 hosts the machine is so
oversubscribed (a 16 MiB push to 32 hosts is 512 MiB through 32 sshd's and 160 Python
processes on 2 cores) that a healthy host can get no CPU for seconds, so those meshes are
started with a 15 s loss limit instead of 3 s (the "loss limit" row): the cut-host row
then measures that limit plus the time to notice.

    sudo .venv/bin/python benchmarks/bench_scale.py [--hosts 1,4,16,32] [--ranks 4] [--push-mib 16]
        [--branchings direct,4,16] [--quick]

A simulated thousand: `--hosts 8 --ranks 128` (1,024 light ranks, about 4.5 MiB of memory each).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import GroupingSink, NullSink, format_seconds  # noqa: E402

from monarch_kernel.controller.state import RELAY_BRANCHING  # noqa: E402

LINES_CODE = "for i in range(1000):\n    print('line', i)"
PUSH_BYTES = [16 << 20]  # --push-mib


def wait_for(predicate, timeout: float, what: str) -> float:
    """Seconds until predicate() holds (polled every 5 ms); raises after timeout."""
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.005)
    return time.perf_counter() - start


def our_pids(hosts, chosen) -> list[int]:
    """Processes in the chosen hosts' namespaces other than their sshd listeners."""
    listeners = {h.sshd.pid for h in chosen if h.sshd is not None}
    found = []
    for host in chosen:
        for pid in hosts.pids(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if pid in listeners or b"sshd" in cmd.split(b"\0")[0] and b"-D" in cmd:
                continue  # the host's own sshd (and the `ip netns exec` shell that became it)
            if b"monarch_kernel" in cmd or b"python" in cmd:
                found.append(pid)
    return found


DIRECT = 1 << 30  # a branching no mesh reaches: the controller sends to every host itself


def start(hosts, count: int, ranks: int, branching: int, name: str):
    import monarch_kernel
    from monarch_kernel import HealthTimings

    health = HealthTimings() if count <= 4 else HealthTimings(host_lost_after_s=15.0, unresponsive_after_s=15.0)
    return monarch_kernel.ssh_mesh([h.alias for h in hosts.hosts[:count]], gpus=ranks, dist="none", preload=[],
                                   python=sys.executable, connect_options=hosts.connect_options(), name=name,
                                   timeout=600, health=health, relay_branching=branching)


def broadcasts(mesh, res: dict[str, float], n: int) -> None:
    mesh.run("pass", sink=NullSink())
    times = []
    cpu0 = time.process_time()
    for _ in range(n):
        t = time.perf_counter()
        mesh.run("pass", sink=NullSink())
        times.append(time.perf_counter() - t)
    res["controller CPU per broadcast"] = (time.process_time() - cpu0) / n
    res["no-op broadcast"] = statistics.median(times)


def pushes(mesh, res: dict[str, float], n: int) -> None:
    import numpy as np

    x = np.ones(PUSH_BYTES[0], dtype=np.uint8)
    mesh.push(x=x)
    times = []
    before = sum(mesh._runtime.bytes_sent().values())
    for _ in range(n):
        t = time.perf_counter()
        mesh.push(x=x)
        times.append(time.perf_counter() - t)
    res["push to all"] = statistics.median(times)
    res["copies of a push leaving the controller"] = (sum(mesh._runtime.bytes_sent().values()) - before) / n / x.nbytes


def fan_out(hosts, count: int, ranks: int, branching: int, quick: bool) -> dict[str, float]:
    """Ready, broadcast, controller CPU and push copies for one branching (the fan-out table)."""
    res: dict[str, float] = {}
    t = time.perf_counter()
    mesh = start(hosts, count, ranks, branching, f"fan{count}-{branching}")
    res["ready"] = time.perf_counter() - t
    try:
        res["relays"] = float(mesh._runtime.relays.active)
        broadcasts(mesh, res, 30 if quick else 100)
        pushes(mesh, res, 2 if quick else 5)
    finally:
        mesh.shutdown()
        wait_for(lambda: not our_pids(hosts, hosts.hosts[:count]), 60, "every process ending")
    return res


def measure(hosts, count: int, ranks: int, quick: bool) -> dict[str, float]:
    from monarch_kernel.core.status import RankStatus

    chosen = hosts.hosts[:count]
    t, cpu = time.perf_counter(), time.process_time()
    mesh = start(hosts, count, ranks, RELAY_BRANCHING, f"scale{count}")
    res: dict[str, float] = {"loss limit": mesh._runtime.spec.health.host_lost_after_s}
    res["ready"] = time.perf_counter() - t
    res["controller CPU to ready"] = time.process_time() - cpu  # the rest is the hosts' own work
    try:
        broadcasts(mesh, res, 30 if quick else 100)

        worst = [0.0]
        printing = threading.Event()

        def probe_status() -> None:
            while printing.is_set():
                t = time.perf_counter()
                mesh.status()
                worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.01)

        sink = GroupingSink(mesh.ranks)
        printing.set()
        prober = threading.Thread(target=probe_status, daemon=True)
        prober.start()
        t = time.perf_counter()
        mesh.run(LINES_CODE, sink=sink, timeout=600)
        res["1,000 lines per rank, shown"] = time.perf_counter() - t
        printing.clear()
        prober.join()
        res["longest status() while printing"] = worst[0]
        assert sink.text.count("line 999") == 1, sink.text[-300:]  # every rank's lines, grouped as one

        pushes(mesh, res, 2 if quick else 5)

        victim = mesh.status()[-1]
        state = {s.rank: s for s in mesh.status()}
        os.kill(victim.pid, signal.SIGKILL)
        res["killed rank reported"] = wait_for(
            lambda: next(s for s in mesh.status() if s.rank == victim.rank).state == RankStatus.DEAD,
            30, "the killed rank's death")
        assert all(s.state != RankStatus.DEAD for s in mesh.status() if s.rank != victim.rank), state

        tree = mesh._runtime.relays.tree
        leaves = [h for i, h in enumerate(chosen) if tree is None or not tree.children.get(i)]
        lost = leaves[-2] if count > 1 else None  # (a one-host mesh has no other host to keep; the last
        if lost is not None:                      # host holds the killed rank)
            hosts.cut_link(lost)
            try:
                res["cut host reported"] = wait_for(
                    lambda: all(s.state == RankStatus.DEAD for s in mesh.status() if s.host == lost.alias),
                    60, "the cut host's loss")
            finally:
                hosts.restore_link(lost)
        if tree is not None:  # a relay host's link cut: its subtree is reported lost, the rest answers
            relay = chosen[0]
            cut = {relay.alias} | {chosen[i].alias for i in tree.below(0)}
            hosts.cut_link(relay)
            try:
                res["relay host cut, its subtree reported"] = wait_for(
                    lambda: all(s.state == RankStatus.DEAD for s in mesh.status() if s.host in cut),
                    60, "the relay subtree's loss")
            finally:
                hosts.restore_link(relay)
            rest = [i for i, h in enumerate(chosen) if h.alias not in cut and h is not lost and h is not chosen[-1]]
            if rest:
                assert mesh.slice(hosts=rest).run("1", sink=NullSink()).values() is not None
    finally:
        t = time.perf_counter()
        mesh.shutdown()
        try:
            res["down until nothing is left"] = time.perf_counter() - t + wait_for(
                lambda: not our_pids(hosts, chosen), 60, "every process ending")
        except TimeoutError as exc:
            print(f"{count} hosts: {exc}: {our_pids(hosts, chosen)}", file=sys.stderr)
    return res


ROWS = ["loss limit", "ready", "controller CPU to ready", "no-op broadcast", "controller CPU per broadcast",
        "1,000 lines per rank, shown", "longest status() while printing", "push to all",
        "copies of a push leaving the controller", "killed rank reported", "cut host reported",
        "relay host cut, its subtree reported", "down until nothing is left"]
FAN_ROWS = ["ready", "no-op broadcast", "controller CPU per broadcast", "copies of a push leaving the controller"]


def table(results: dict[int, dict[str, float]], ranks: int) -> str:
    counts = sorted(results)
    lines = [f"(push row: {PUSH_BYTES[0] >> 20} MiB to every host)",
             "| " + " | ".join(["hosts x ranks"] + [f"{c} x {ranks} ({c * ranks} ranks)" for c in counts]
                               + [f"{counts[-1]} vs {counts[0]} hosts"]) + " |",
             "|" + "---|" * (len(counts) + 2)]
    for row in ROWS:
        cells = []
        for c in counts:
            value = results[c].get(row)
            if value is None:
                cells.append("-")
            elif row == "loss limit":
                cells.append(f"{value:.0f} s")
            elif row.startswith("copies"):
                cells.append(f"{value:.1f}")
            elif row == "push to all":
                cells.append(f"{format_seconds(value)} ({c * PUSH_BYTES[0] / value / 1e9:.2f} GB/s out)")
            else:
                cells.append(format_seconds(value))
        first, last = results[counts[0]].get(row), results[counts[-1]].get(row)
        growth = f"{last / first:.1f}x" if first and last else "-"
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {growth} |")
    return "\n".join(lines)


def fan_table(fans: dict[str, dict[int, dict[str, float]]]) -> str:
    counts = sorted(next(iter(fans.values())))
    lines = ["| fan-out | " + " | ".join(f"{c} hosts" for c in counts) + " |", "|" + "---|" * (len(counts) + 1)]
    for row in FAN_ROWS:
        for label, results in fans.items():
            cells = []
            for c in counts:
                value = results.get(c, {}).get(row)
                relayed = results.get(c, {}).get("relays")
                if value is None:
                    cells.append("-")
                else:
                    text = f"{value:.1f}" if row.startswith("copies") else format_seconds(value)
                    cells.append(text + (" (relayed)" if relayed else ""))
            lines.append(f"| {row}, {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[int, dict[str, float]], fans: dict[str, dict[int, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(results)
    shown = [row for row in ROWS if row != "loss limit"]
    fig, axes = plt.subplots(4, 4, figsize=(16, 13))
    cells = list(axes.flat)
    for ax, row in zip(cells, shown):
        xs = [c for c in counts if row in results[c]]
        scale = 1 if row.startswith("copies") else 1000
        ax.plot(xs, [results[c][row] * scale for c in xs], marker="o")
        ax.set_title(row, fontsize=10)
        ax.set_ylabel("copies" if row.startswith("copies") else "ms")
    for ax, row in zip(cells[len(shown):], FAN_ROWS):
        for label, fan in fans.items():
            xs = sorted(c for c in fan if row in fan[c])
            scale = 1 if row.startswith("copies") else 1000
            ax.plot(xs, [fan[c][row] * scale for c in xs], marker="o", label=label)
        ax.set_title(f"fan-out: {row}", fontsize=10)
        ax.set_ylabel("copies" if row.startswith("copies") else "ms")
        ax.legend(fontsize=8)
    for ax in cells:
        ax.set_xlabel("hosts")
        ax.set_xticks(counts)
        ax.grid(alpha=0.3)
    for ax in cells[len(shown) + len(FAN_ROWS):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", default="1,4,16,32")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--push-mib", type=int, default=16, help="the push row's size per host")
    parser.add_argument("--branchings", default="direct,4,16", help="relay branchings for the fan-out table")
    parser.add_argument("--fan-ranks", type=int, default=1, help="ranks per host in the fan-out meshes")
    parser.add_argument("--only-fan-out", action="store_true", help="skip the main table")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "..", "artifacts"))
    args = parser.parse_args()
    from sshhosts import SSHTestHosts
    from sshhosts import unavailable_reason as no_ssh

    if no_ssh():
        sys.exit(f"cannot build the test hosts here: {no_ssh()}")
    counts = sorted(int(c) for c in args.hosts.split(","))
    PUSH_BYTES[0] = args.push_mib << 20
    hosts = SSHTestHosts(counts[-1], tempfile.mkdtemp(prefix="scale-"), client_alive=(5, 3))
    results: dict[int, dict[str, float]] = {}
    fans: dict[str, dict[int, dict[str, float]]] = {}
    branchings = [b.strip() for b in args.branchings.split(",") if b.strip()]
    try:
        hosts.start()
        for count in counts:
            print(f"{count} hosts x {args.ranks} ranks ...", file=sys.stderr, flush=True)
            results[count] = {} if args.only_fan_out else measure(hosts, count, args.ranks, args.quick)
            for b in branchings:
                label = "direct" if b == "direct" else f"branching {b}"
                fans.setdefault(label, {})[count] = fan_out(hosts, count, args.fan_ranks,
                                                            DIRECT if b == "direct" else int(b), args.quick)
    finally:
        hosts.stop()
    text = ("" if args.only_fan_out else table(results, args.ranks) + "\n\n") + \
        f"Fan-out (same run; a mesh per branching, {args.fan_ranks} rank(s) per host):\n\n" + fan_table(fans)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_scale.md"), "w") as f:
        f.write(text + "\n")
    plot(results, fans, os.path.join(args.out, "bench_scale.png"))
    print(f"\n(table and plot in {os.path.abspath(args.out)}: bench_scale.md, bench_scale.png)")


if __name__ == "__main__":
    main()
