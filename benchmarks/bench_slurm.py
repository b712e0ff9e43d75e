"""Slurm benchmark: a 2-node x 2-rank mesh on the test Slurm cluster, next to an SSH mesh of the same shape.

Builds the test cluster (tests/slurmlab.py) and the SSH test hosts (both need root), then
measures, in one run, with bench_ssh's measurements: startup (submission, scheduling,
agents, ranks ready), no-op broadcast, and 64 MiB pull/push, for both meshes.

    sudo .venv/bin/python benchmarks/bench_slurm.py [--quick]

The peers the issue names (ipyparallel's Slurm engines, dask-jobqueue's SLURMCluster) are
not measured here yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from bench_ssh import MIB64, measure_mesh  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from slurmlab import SlurmTestCluster
    from slurmlab import unavailable_reason as no_slurm
    from sshhosts import SSHTestHosts
    from sshhosts import unavailable_reason as no_ssh

    for why in (no_slurm(), no_ssh()):
        if why:
            sys.exit(f"cannot build the test cluster or hosts here: {why}")
    import monarch_kernel

    cluster = SlurmTestCluster(2, tempfile.mkdtemp(prefix="slurmlab-"))
    hosts = SSHTestHosts(2, tempfile.mkdtemp())
    try:
        cluster.start()
        hosts.start()
        os.environ.update(cluster.env)
        results = {
            "slurm 2x2": measure_mesh(lambda: monarch_kernel.slurm_mesh(nodes=2, gpus=2, dist="gloo", request_gpus=False,
                                                                   name="bench-slurm"), args.quick),
            "ssh 2x2": measure_mesh(lambda: monarch_kernel.ssh_mesh([h.alias for h in hosts.hosts], gpus=2, dist="gloo",
                                                               python=sys.executable,
                                                               connect_options=hosts.connect_options(),
                                                               name="bench-ssh"), args.quick),
        }
    finally:
        hosts.stop()
        cluster.stop()
    print("| 2 hosts x 2 ranks (medians) | Slurm mesh | SSH mesh | Slurm / SSH |")
    print("|---|---|---|---|")
    for row in results["slurm 2x2"]:
        a, b = statistics.median(results["slurm 2x2"][row]), statistics.median(results["ssh 2x2"][row])
        if row.startswith(("pull", "push")):
            shown = f"{MIB64 / a / 1e9:.2f} GB/s | {MIB64 / b / 1e9:.2f} GB/s | {b / a:.2f}x speed"
        elif a < 1:
            shown = f"{a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {a / b:.2f}x time"
        else:
            shown = f"{a:.2f} s | {b:.2f} s | {a / b:.2f}x time"
        print(f"| {row} | {shown} |")


if __name__ == "__main__":
    main()
