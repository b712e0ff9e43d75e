"""Ray benchmark on the test cluster (tests/raylab.py): readiness and data path against SSH, calls against Ray's own.

Needs root (it builds the test Ray cluster, head and 2 worker nodes with 2 logical GPUs each, and the
SSH test hosts). In one run, each row for both systems, rotated per round:

1. Ready: from asking for 2 hosts x 2 ranks (gloo) to the first result from every rank, for
   `ray_mesh(ray://head, hosts=2, gpus=2)` and `ssh_mesh([host-0, host-1], gpus=2)` (issue 39's target:
   Ray within 2x of SSH), each after the machine settled (SETTLE_S); and Ray's own floor for the same
   reservation (a placement group of 4 GPU bundles, an actor in each, a call on each).
2. Data path of the 2 x 2 mesh (Ray is the placement engine, not the data path): no-op broadcast, a
   64 MiB pull from one rank and a 64 MiB push to all, on the Ray mesh and on the SSH mesh.
3. Calls: an endpoint on all 4 ranks, our actor mesh on the Ray mesh, against Ray's own way of doing the
   same (one Ray actor per rank in a placement group, `ray.get` of a method call on each), from this client.

    sudo .venv/bin/python benchmarks/bench_ray.py [--quick]
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
from bench_ssh import MIB64  # noqa: E402
from common import NullSink, timed  # noqa: E402

SETTLE_S = 5.0  # before each start: the last mesh's end makes Ray start fresh idle workers (seconds of CPU here)


def data_path(mesh, quick: bool) -> dict[str, list[float]]:
    """No-op broadcast, a 64 MiB pull from the last host's first rank and a 64 MiB push to all."""
    import torch

    res = {"no-op broadcast": timed(lambda: mesh.run("pass", sink=NullSink()), 100 if quick else 300, 10)}
    mesh.run(f"import torch\nt = torch.randn({MIB64 // 4})", sink=NullSink())
    one = mesh.slice(hosts=mesh.shape.sizes["hosts"] - 1, gpus=0)
    res["pull 64 MiB"] = timed(lambda: one.pull("t"), 3 if quick else 8, 1)
    x = torch.randn(MIB64 // 4)
    res["push 64 MiB to all"] = timed(lambda: mesh.push(t=x), 3 if quick else 8, 1)
    return res


def ours_calls(mesh, quick: bool) -> list[float]:
    import monarch_kernel

    class Echo(monarch_kernel.Actor):
        @monarch_kernel.endpoint
        def ping(self, x):
            return x

    echo = mesh.spawn("echo", Echo)
    return timed(lambda: echo.ping.call(1).get(timeout=30), 100 if quick else 300, 10)


def rays_own_ready() -> float:
    """Ray's floor for the same reservation: a placement group of 4 GPU bundles, an actor in each, a call on each."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    class Holder:
        def where(self):
            import socket

            return socket.gethostname()

    t = time.perf_counter()
    group = placement_group([{"GPU": 1}] * 4, strategy="PACK")
    ray.get(group.ready(), timeout=120)
    actors = [Holder.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote() for i in range(4)]
    ray.get([a.where.remote() for a in actors], timeout=120)
    elapsed = time.perf_counter() - t
    for actor in actors:
        ray.kill(actor)
    remove_placement_group(group)
    return elapsed


def rays_calls(quick: bool) -> list[float]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    class Echo:
        def ping(self, x):
            return x

    group = placement_group([{"GPU": 1}] * 4, strategy="PACK")
    ray.get(group.ready(), timeout=120)
    actors = [Echo.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
              .remote() for i in range(4)]
    try:
        ray.get([a.ping.remote(0) for a in actors], timeout=120)
        return timed(lambda: ray.get([a.ping.remote(1) for a in actors], timeout=30), 100 if quick else 300, 10)
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from raylab import RayTestCluster
    from raylab import unavailable_reason as no_ray
    from sshhosts import SSHTestHosts
    from sshhosts import unavailable_reason as no_ssh

    for why in (no_ray(), no_ssh()):
        if why:
            sys.exit(f"cannot build the test cluster or hosts here: {why}")
    cluster = RayTestCluster(2, tempfile.mkdtemp(prefix="raylab-"), gpus=2)
    hosts = SSHTestHosts(2, tempfile.mkdtemp())
    rounds = 1 if args.quick else 3
    ready: dict[str, list[float]] = {"Ray": [], "SSH": []}
    paths: dict[str, dict[str, list[float]]] = {}
    calls: dict[str, list[float]] = {}
    try:
        cluster.start()
        hosts.start()
        os.environ.update(cluster.env)
        import monarch_kernel

        makers = {
            "Ray": lambda n: monarch_kernel.ray_mesh(cluster.address, hosts=2, gpus=2, dist="gloo", name=f"bray{n}"),
            "SSH": lambda n: monarch_kernel.ssh_mesh([h.alias for h in hosts.hosts], gpus=2, dist="gloo",
                                                     python=sys.executable, connect_options=hosts.connect_options(),
                                                     name=f"bssh{n}"),
        }
        monarch_kernel.ray_mesh(cluster.address, hosts=2, gpus=2, dist="none", name="warmup").shutdown()
        names = list(makers)
        for i in range(rounds):
            time.sleep(SETTLE_S)
            ready.setdefault("Ray's own floor: placement group + 4 actors + a call on each", []).append(
                rays_own_ready())
            for name in names[i % 2:] + names[:i % 2]:
                time.sleep(SETTLE_S)
                t = time.perf_counter()
                mesh = makers[name](i)
                try:
                    mesh.run("import socket\nsocket.gethostname()", sink=NullSink())
                    ready[name].append(time.perf_counter() - t)
                    if i == rounds - 1:
                        paths[name] = data_path(mesh, args.quick)
                        if name == "Ray":
                            calls["monarch-kernel actor mesh on the Ray mesh, endpoint on 4 ranks"] = \
                                ours_calls(mesh, args.quick)
                finally:
                    mesh.shutdown()
        calls["Ray's own: 4 actors in a placement group, ray.get of a call on each"] = rays_calls(args.quick)
    finally:
        try:
            import ray

            ray.shutdown()
        except ImportError:
            pass
        hosts.stop()
        cluster.stop()

    print("| 2 hosts x 2 ranks, ask -> first result from every rank | median | each round | Ray / SSH |")
    print("|---|---|---|---|")
    base = statistics.median(ready["SSH"])
    for name, times in ready.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.2f} s | {', '.join(f'{t:.2f}' for t in times)} | {median / base:.2f}x |")
    print()
    print("| 2 x 2 mesh (medians) | Ray mesh | SSH mesh | Ray / SSH |")
    print("|---|---|---|---|")
    for row in paths["Ray"]:
        ray_v, ssh_v = statistics.median(paths["Ray"][row]), statistics.median(paths["SSH"][row])
        if row.startswith(("pull", "push")):
            print(f"| {row} | {MIB64 / ray_v / 1e9:.2f} GB/s | {MIB64 / ssh_v / 1e9:.2f} GB/s | "
                  f"{ray_v / ssh_v:.2f}x time |")
        else:
            print(f"| {row} | {ray_v * 1e3:.2f} ms | {ssh_v * 1e3:.2f} ms | {ray_v / ssh_v:.2f}x time |")
    print()
    print("| a call on 4 ranks from the notebook (median) | ms | vs Ray's own |")
    print("|---|---|---|")
    rays = statistics.median(calls["Ray's own: 4 actors in a placement group, ray.get of a call on each"])
    for name, times in calls.items():
        print(f"| {name} | {statistics.median(times) * 1e3:.2f} | {statistics.median(times) / rays:.2f}x |")


if __name__ == "__main__":
    main()
