"""Same-run A/B of the rows that ride our own TCP links, against an earlier commit: what encryption costs.

The links between ranks of different hosts (far calls), and the Slurm step link that carries a node's
pushes and pulls, were authenticated (HMAC) but in clear before; they are AES-GCM records after an
ephemeral key exchange now (wire/link_crypto.py). SSH meshes' pushes and pulls ride SSH channels either
way (a control row: they should not move).

One SSH test-host pair and one test Slurm cluster are built once; each round then runs the measuring
child once with the earlier commit's package first on the path and once with this checkout's, the order
alternating, so that both see the same machine at the same time. The SSH agents get the child's own
package (ship_package=True); the Slurm steps inherit its PYTHONPATH through srun.

    sudo .venv/bin/python benchmarks/link_ab.py 32aa32d [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

MIB64 = 64 << 20
ROWS = ("SSH: actor -> actor of another proc mesh on the other host (per call)",
        "SSH: pull 64 MiB (SSH channel: control)",
        "SSH: push 64 MiB to all (SSH channel: control)",
        "Slurm: pull 64 MiB (step link)",
        "Slurm: push 64 MiB to all (step link)",
        "Slurm: no-op broadcast",
        "Slurm: actor -> actor of another proc mesh on the other node (per call)")


def child(hosts: list[str], options: dict, quick: bool) -> dict[str, list[float]]:
    """Every row, with whichever monarch_kernel is first on the path."""
    import torch
    from common import NullSink, cross_mesh_times, timed

    import monarch_kernel
    from monarch_kernel.monarch import actor as api

    n = 3 if quick else 6
    out: dict[str, list[float]] = {}

    def transfers(mesh, prefix: str, label: str) -> None:
        mesh.run(f"import torch\nt = torch.randn({MIB64 // 4})", sink=NullSink())
        one = mesh.slice(hosts=1, gpus=0)
        out[f"{prefix}: pull 64 MiB{label}"] = timed(lambda: one.pull("t"), n, 1)
        x = torch.randn(MIB64 // 4)
        out[f"{prefix}: push 64 MiB to all{label}"] = timed(lambda: mesh.push(t=x), n, 1)

    def far_call(mesh, row: str) -> None:
        host_mesh = mesh.host_mesh()
        procs_a = host_mesh.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, dist="none")
        procs_b = host_mesh.slice(hosts=1).spawn_procs(per_host={"gpus": 1}, dist="none")
        try:
            out[row] = cross_mesh_times(api, procs_a, procs_b, 200, n)
        finally:
            procs_a.stop()
            procs_b.stop()

    mesh = monarch_kernel.ssh_mesh(hosts, gpus=2, dist="none", python=sys.executable, connect_options=options,
                                   name="ab-ssh", ship_package=True)
    try:
        far_call(mesh, ROWS[0])
        transfers(mesh, "SSH", " (SSH channel: control)")
    finally:
        mesh.shutdown()
    mesh = monarch_kernel.slurm_mesh(nodes=2, gpus=2, dist="none", request_gpus=False, name="ab-slurm",
                                     python=sys.executable)
    try:
        transfers(mesh, "Slurm", " (step link)")
        out[ROWS[5]] = timed(lambda: mesh.run("pass", sink=NullSink()), 100 if quick else 300, 10)
        far_call(mesh, ROWS[6])
    finally:
        mesh.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ref", nargs="?", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["hosts"], spec["options"], args.quick)))
        return
    from ab_commits import worktree
    from slurmlab import SlurmTestCluster
    from slurmlab import unavailable_reason as no_slurm
    from sshhosts import SSHTestHosts
    from sshhosts import unavailable_reason as no_ssh

    for why in (no_slurm(), no_ssh()):
        if why:
            sys.exit(f"cannot build the test cluster or hosts here: {why}")
    arms = {"before": worktree(args.ref), "after": ROOT}
    cluster = SlurmTestCluster(2, tempfile.mkdtemp(prefix="slurmlab-"))
    results: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
    with SSHTestHosts(2, tempfile.mkdtemp()) as hosts:
        try:
            cluster.start()
            spec = json.dumps({"hosts": [h.alias for h in hosts.hosts], "options": hosts.connect_options()})
            for round_ in range(args.rounds):
                for arm in (list(arms) if round_ % 2 == 0 else list(reversed(arms))):
                    env = dict(os.environ, **cluster.env, PYTHONPATH=arms[arm])
                    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec]
                                          + (["--quick"] if args.quick else []), env=env, cwd=arms[arm],
                                          capture_output=True, text=True, timeout=1800)
                    if done.returncode != 0:
                        sys.exit(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
                    for row, times in json.loads(done.stdout.strip().splitlines()[-1]).items():
                        results[arm].setdefault(row, []).append(statistics.median(times))
        finally:
            cluster.stop()
    print(f"| row (median of {args.rounds} rounds' medians) | before ({args.ref}) | after (this checkout) | after / before |")
    print("|---|---|---|---|")
    for row in ROWS:
        before, after = statistics.median(results["before"][row]), statistics.median(results["after"][row])
        if "64 MiB" in row:
            cells = [f"{MIB64 / before / 1e9:.2f} GB/s", f"{MIB64 / after / 1e9:.2f} GB/s"]
        else:
            cells = [f"{before * 1e3:.3f} ms", f"{after * 1e3:.3f} ms"]
        print(f"| {row} | {cells[0]} | {cells[1]} | {after / before:.2f}x time |")


if __name__ == "__main__":
    main()
