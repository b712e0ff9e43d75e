"""Slurm benchmark on the test cluster (tests/slurmlab.py): readiness against the peers, and the mesh's data path.

Needs root (it builds the test Slurm cluster and the SSH test hosts). In one run:

1. Ready: from asking for 2 nodes to the first result from each of them, for
   `slurm_mesh(nodes=2)` (without torch.distributed, and with gloo across the nodes),
   ipyparallel's Slurm engines (`Cluster(engines="slurm", n=2)`) and dask-jobqueue's
   `SLURMCluster` with 2 workers (one job each). Every system gets one worker per node;
   the order is rotated each round, after one warm-up job.
2. Data path of a 2-node x 2-rank mesh: no-op broadcast and 64 MiB pull/push, on the
   Slurm mesh with its direct link, the same with all traffic on srun's stdio
   (`direct=False`), and an SSH mesh of the same shape (bench_ssh's measurements).

    sudo .venv/bin/python benchmarks/bench_slurm.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from bench_ssh import MIB64, measure_mesh  # noqa: E402

SETTLE_S = 4.0  # longer than Slurm's default batch_sched_delay
ROOT_ADDRESS = "198.19.0.1"  # the test cluster's bridge: where the peers' workers reach their schedulers


def ready_monarch(dist: str):
    def run() -> float:
        from common import NullSink

        import monarch_kernel

        t = time.perf_counter()
        mesh = monarch_kernel.slurm_mesh(nodes=2, gpus=1, dist=dist, request_gpus=False, name=f"ready-{dist}")
        try:
            names = mesh.run("import socket\nsocket.gethostname()", sink=NullSink())
            elapsed = time.perf_counter() - t
            assert sorted(names.values()) == ["node0", "node1"], names
        finally:
            mesh.shutdown()
        return elapsed
    return run


def ready_ipyparallel() -> float:
    import ipyparallel as ipp
    from traitlets.config import Config

    config = Config()
    config.SlurmEngineSetLauncher.batch_template = (
        "#!/bin/sh\n#SBATCH --job-name=ipengine-{cluster_id}\n#SBATCH --nodes={n}\n#SBATCH --ntasks-per-node=1\n"
        "#SBATCH --output=/dev/null\nsrun {program_and_args}\n")
    t = time.perf_counter()
    cluster = ipp.Cluster(engines="slurm", n=2, controller_ip=ROOT_ADDRESS, log_level=40, config=config,
                          profile_dir=tempfile.mkdtemp(prefix="ipp-"))
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(2, timeout=120)
        names = client[:].apply_sync(socket.gethostname)
        elapsed = time.perf_counter() - t
        assert sorted(names) == ["node0", "node1"], names
        client.close()
    finally:
        cluster.stop_cluster_sync()
    return elapsed


def ready_dask() -> float:
    from dask.distributed import Client
    from dask_jobqueue import SLURMCluster

    t = time.perf_counter()
    # cores=2: each worker's job takes a whole node (2 CPUs), so the two land on different nodes
    cluster = SLURMCluster(cores=2, processes=1, memory="400MB", walltime="00:10:00", python=sys.executable,
                           scheduler_options={"host": ROOT_ADDRESS}, job_directives_skip=["--mem"],
                           log_directory=tempfile.mkdtemp(prefix="dask-"))
    try:
        cluster.scale(jobs=2)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=120)
            names = client.run(socket.gethostname)
            elapsed = time.perf_counter() - t
        assert sorted(names.values()) == ["node0", "node1"], names
    finally:
        cluster.close()
    return elapsed


def wait_idle(cluster, timeout: float = 60) -> None:
    """Between systems: every job of the last one has left the queue and the nodes are idle.

    Each system then submits to an idle, quiet cluster, where Slurm's batch_sched_delay (3 s
    by default) holds every new batch job (all three systems submit batch jobs); a job
    submitted while the last one's completion is still being processed is started by that
    event instead, which favoured whoever came next (dask after ipyparallel: 1.1 s instead of 2.9 s).
    """
    deadline = time.monotonic() + timeout
    while (cluster.squeue().strip() or not cluster.all_idle()) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(SETTLE_S)


def measure_ready(cluster, rounds: int) -> dict[str, list[float]]:
    systems = {"monarch-kernel slurm_mesh(nodes=2), no torch.distributed": ready_monarch("none"),
               "monarch-kernel slurm_mesh(nodes=2, dist='gloo')": ready_monarch("gloo"),
               "ipyparallel Cluster(engines='slurm', n=2)": ready_ipyparallel,
               "dask-jobqueue SLURMCluster, 2 workers": ready_dask}
    subprocess.run(["srun", "-N2", "true"], env={**os.environ, **cluster.env}, check=True, timeout=60)  # warm-up
    names = list(systems)
    results: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            wait_idle(cluster)
            try:
                results[name].append(systems[name]())
            except Exception as exc:  # a peer that will not run here is reported, not fatal
                print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return results


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

    os.chdir(tempfile.mkdtemp(prefix="bench-slurm-"))  # the peers write job scripts and slurm-N.out files here
    cluster = SlurmTestCluster(2, tempfile.mkdtemp(prefix="slurmlab-"))
    hosts = SSHTestHosts(2, tempfile.mkdtemp())
    try:
        cluster.start()
        hosts.start()
        os.environ.update(cluster.env)
        ready = measure_ready(cluster, 1 if args.quick else 3)
        paths = {
            "Slurm, direct link": measure_mesh(lambda: monarch_kernel.slurm_mesh(
                nodes=2, gpus=2, dist="gloo", request_gpus=False, name="bench-direct"), args.quick),
            "Slurm, srun stdio": measure_mesh(lambda: monarch_kernel.slurm_mesh(
                nodes=2, gpus=2, dist="gloo", request_gpus=False, name="bench-stdio", direct=False), args.quick),
            "SSH": measure_mesh(lambda: monarch_kernel.ssh_mesh(
                [h.alias for h in hosts.hosts], gpus=2, dist="gloo", python=sys.executable,
                connect_options=hosts.connect_options(), name="bench-ssh"), args.quick),
        }
    finally:
        hosts.stop()
        cluster.stop()

    print("| asking for 2 nodes -> first result from each (median of rounds) | seconds | each round | "
          "vs monarch-kernel (no dist) |")
    print("|---|---|---|---|")
    base = statistics.median(next(iter(ready.values())) or [float("nan")])
    for name, times in ready.items():
        if times:
            median = statistics.median(times)
            each = ", ".join(f"{t:.2f}" for t in times)
            print(f"| {name} | {median:.2f} s | {each} | {median / base:.2f}x |")
        else:
            print(f"| {name} | did not run (see stderr) | | |")
    print()
    columns = list(paths)
    print("| 2 nodes x 2 ranks (medians) | " + " | ".join(columns) + " | direct / stdio | direct / SSH |")
    print("|---|" + "---|" * (len(columns) + 2))
    for row in paths[columns[0]]:
        values = [statistics.median(paths[c][row]) for c in columns]
        if row.startswith(("pull", "push")):
            cells = [f"{MIB64 / v / 1e9:.2f} GB/s" for v in values]
            ratios = [f"{values[1] / values[0]:.1f}x speed", f"{values[2] / values[0]:.2f}x speed"]
        else:
            cells = [f"{v * 1e3:.2f} ms" if v < 1 else f"{v:.2f} s" for v in values]
            ratios = [f"{values[0] / values[1]:.2f}x time", f"{values[0] / values[2]:.2f}x time"]
        print(f"| {row} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
