"""Fault-storm report: hundreds of faults on a local mesh and on SSH test hosts, per fault kind.

Each round injects one fault (rank SIGKILL, SIGSTOP/SIGCONT, agent SIGKILL, a cut link,
the notebook thread holding the GIL for 10 s, a stop at a random moment of a cell, a push
or a start, a restart mid-cell, oversized and non-UTF-8 output, unpicklable values, a shm
write that fails) into real work, then checks the invariants of tests/faultstorm.py. The
table shows, per fault kind: injected, detected, time to detect (median and max), recovered,
and broken invariants; then what was left after `down`, next to the promised detection times.

    sudo .venv/bin/python benchmarks/fault_storm.py [--rounds 500] [--seconds S] [--seed N]
                                                    [--mode local|ssh|both] [--gpus 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from faultstorm import HOST_DETECT_S, RANK_DETECT_S, SERVER_CLIENT_ALIVE, FaultStorm, Report  # noqa: E402
from sshhosts import SSHTestHosts, unavailable_reason  # noqa: E402

from monarch_kernel import HealthTimings, local_mesh, ssh_mesh  # noqa: E402

RANK_FAULTS = ("rank_sigkill",)
HOST_FAULTS = ("agent_sigkill", "link_down_up")


def promised(report: Report) -> list[str]:
    """Whether the storm met the targets: detection times, nothing lost, nothing leaked."""
    lines = []
    for kinds, limit, what in ((RANK_FAULTS, RANK_DETECT_S, "dead rank"), (HOST_FAULTS, HOST_DETECT_S, "lost host")):
        times = [o.detect_s for o in report.outcomes if o.kind in kinds and o.detect_s is not None]
        if times:
            worst = max(times)
            lines.append(f"{what} named within {limit:g} s: worst {worst:.3f} s over {len(times)} "
                         f"-> {'met' if worst <= limit else 'MISSED'}")
    gil = [o for o in report.outcomes if o.kind == "gil_hold_10s"]
    if gil:
        lost = sum(1 for o in gil if o.problems)
        lines.append(f"meshes lost to a notebook holding the GIL 10 s: {lost} of {len(gil)}")
    lines.append(f"broken invariants: {len(report.problems)}; leaked after down: "
                 f"{'; '.join(report.leaks) if report.leaks else 'nothing'}")
    return lines


def show(report: Report, title: str) -> None:
    print(f"\n## {title}: {len(report.outcomes)} rounds in {report.seconds:.0f} s, seed {report.seed}")
    print(report.table())
    for line in promised(report):
        print("- " + line)
    for problem in report.problems[:40]:
        print("  ! " + problem)
    if report.problems:
        print(f"  replay: --seed {report.seed} --mode {report.mode}")


def progress(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long instead")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--mode", choices=("local", "ssh", "both"), default="both")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per host")
    parser.add_argument("--gil-weight", type=float, default=0.2, help="how often 10 s GIL holds come, relative to 1")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"fault storm: seed {seed}, {args.rounds} rounds per mode, {args.gpus} ranks per host, "
          f"default health timings (promised: rank {RANK_DETECT_S:g} s, host {HOST_DETECT_S:g} s)")
    weights = {"gil_hold_10s": args.gil_weight}
    if args.mode in ("local", "both"):
        storm = FaultStorm(lambda: local_mesh(gpus=args.gpus, dist="gloo", name="storm"), seed=seed,
                           weights=weights, log=progress)
        show(storm.run(rounds=args.rounds, seconds=args.seconds), "local mesh (1 host)")
    if args.mode in ("ssh", "both"):
        why = unavailable_reason()
        if why:
            print(f"\n## SSH test hosts: skipped ({why})")
            return
        hosts = SSHTestHosts(2, tempfile.mkdtemp(prefix="storm-ssh-"), client_alive=SERVER_CLIENT_ALIVE)
        try:
            hosts.start()

            def make():
                return ssh_mesh([h.alias for h in hosts.hosts], gpus=args.gpus, dist="gloo", python=sys.executable,
                                connect_options=hosts.connect_options(), name="stormssh",
                                health=HealthTimings(controller_silence_s=30.0))

            storm = FaultStorm(make, seed=seed, hosts=hosts, weights=weights, log=progress)
            show(storm.run(rounds=args.rounds, seconds=args.seconds), "SSH test hosts (2 hosts, sshd in namespaces)")
        finally:
            hosts.stop()


if __name__ == "__main__":
    main()
