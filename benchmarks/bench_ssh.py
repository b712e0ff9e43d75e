"""SSH benchmark: a 2-host x 2-rank mesh on network-namespace test hosts (needs root).

Compares, in one run: startup, no-op broadcast round trip, 64 MiB push/pull and a call between the
actors of two proc meshes (one on each host) of the SSH mesh, next to a local 4-rank mesh, with plain
OpenSSH transfers of the same bytes (`ssh host cat > /dev/null`, `ssh host head -c`) as the floor.

    sudo .venv/bin/python benchmarks/bench_ssh.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import NullSink, cross_mesh_times, format_seconds, report, timed  # noqa: E402

MIB64 = 64 << 20
CROSS = "actor -> actor of another proc mesh (per call)"
ATTACH = "attach after a kernel restart"
FIRST_KERNEL = """
import json, sys
import monarch_kernel as mk
hosts, options = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if hosts:
    mk.ssh_mesh(hosts, 2, dist="gloo", python=sys.executable, connect_options=options, name="bench-attach", persist="10m")
else:
    mk.local_mesh(4, dist="gloo", name="bench-attach", persist="10m")
"""
NEXT_KERNEL = """
import time
import monarch_kernel
import monarch_kernel.api.persistent
t = time.perf_counter()
mesh = monarch_kernel.attach("bench-attach")
mesh.run("1")
print("TOOK", time.perf_counter() - t, flush=True)
"""


def measure_mesh(make, quick: bool) -> dict:
    """Startup, broadcast, pull and push for the mesh that make() starts."""
    import torch

    t = time.perf_counter()
    mesh = make()
    res = {"startup": [time.perf_counter() - t]}
    try:
        res["no-op broadcast"] = timed(lambda: mesh.run("pass", sink=NullSink()), 100 if quick else 300, 10)
        mesh.run(f"import torch\nt = torch.randn({MIB64 // 4})", sink=NullSink())
        one = mesh.slice(hosts=mesh.shape.sizes["hosts"] - 1, gpus=0)
        res["pull 64 MiB"] = timed(lambda: one.pull("t"), 3 if quick else 8, 1)
        x = torch.randn(MIB64 // 4)
        res["push 64 MiB to all"] = timed(lambda: mesh.push(t=x), 3 if quick else 8, 1)
        res[CROSS] = _cross_mesh(mesh, quick)
    finally:
        mesh.shutdown()
    return res


def _cross_mesh(mesh, quick: bool) -> list[float]:
    """An actor of a proc mesh on the first host calling an actor of one on the last host (Monarch's API)."""
    from monarch_kernel.monarch import actor as api

    host_mesh = mesh.host_mesh()
    last = host_mesh.extent["hosts"] - 1
    procs_a = host_mesh.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, dist="none")
    procs_b = host_mesh.slice(hosts=last).spawn_procs(per_host={"gpus": 1}, dist="none")
    try:
        return cross_mesh_times(api, procs_a, procs_b, 200, 3 if quick else 8)
    finally:
        procs_a.stop()
        procs_b.stop()


def measure_attach(hosts: list[str], options: dict, quick: bool) -> list[float]:
    """A persistent mesh left by a kernel, attached (and a first cell run) by fresh interpreters, each timed."""
    import json

    env = dict(os.environ, XDG_STATE_HOME=tempfile.mkdtemp())
    subprocess.run([sys.executable, "-c", FIRST_KERNEL, json.dumps(hosts), json.dumps(options)], env=env, check=True,
                   capture_output=True, timeout=300)
    times = []
    try:
        for _ in range(3 if quick else 8):
            done = subprocess.run([sys.executable, "-c", NEXT_KERNEL], env=env, capture_output=True, text=True,
                                  timeout=120)
            times += [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("TOOK")]
    finally:
        subprocess.run([sys.executable, "-m", "monarch_kernel", "meshes", "stop", "bench-attach"], env=env,
                       capture_output=True, timeout=120)
    return times


def measure_floor(hosts, quick: bool) -> dict:
    """Plain OpenSSH moving the same bytes: the floor for our SSH transfers."""
    host = hosts.hosts[-1].alias
    payload = os.urandom(MIB64)
    base = ["ssh", "-F", hosts.config, "-o", "BatchMode=yes", host]

    def push():
        subprocess.run(base + ["cat > /dev/null"], input=payload, check=True)

    def pull():
        out = subprocess.run(base + [f"head -c {MIB64} /dev/zero"], capture_output=True, check=True).stdout
        assert len(out) == MIB64

    n = 3 if quick else 8
    return {"pull 64 MiB": timed(pull, n, 1), "push 64 MiB to all": timed(push, n, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from sshhosts import SSHTestHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot make SSH test hosts here: {reason}")
    import monarch_kernel

    hosts = SSHTestHosts(2, tempfile.mkdtemp()).start()
    try:
        results = {
            "local 1x4": measure_mesh(lambda: monarch_kernel.local_mesh(gpus=4, dist="gloo"), args.quick),
            "ssh 2x2": measure_mesh(lambda: monarch_kernel.ssh_mesh(
                [h.alias for h in hosts.hosts], gpus=2, dist="gloo", python=sys.executable,
                connect_options=hosts.connect_options()), args.quick),
            "ssh cat (floor)": measure_floor(hosts, args.quick),
        }
        results["local 1x4"][ATTACH] = measure_attach([], {}, args.quick)
        results["ssh 2x2"][ATTACH] = measure_attach([h.alias for h in hosts.hosts], hosts.connect_options(), args.quick)
    finally:
        hosts.stop()
    ours = {"ssh 2x2": results.pop("ssh 2x2")}  # the first column is the one compared
    print(report({**ours, **results}, ["startup", "no-op broadcast", "pull 64 MiB", "push 64 MiB to all", CROSS, ATTACH],
                 "benchmark", _fmt))
    print("\n(push to all: the time until every rank of the mesh has the tensor; the floor sends it once. "
          "Proc meshes: on the first and the last host of the mesh, Monarch's ping-pong; its same-host "
          "figure next to PyTorch Monarch's is in bench_actors.py. Attach: a persistent mesh left by a kernel that "
          "ended, taken back by a fresh interpreter with a first cell (one new SSH connection per host); "
          "bench_persist.py compares it with IPython Parallel)")


def _fmt(seconds: float, row: str) -> str:
    return f"{MIB64 / seconds / 1e9:.2f} GB/s" if "64 MiB" in row else format_seconds(seconds)


if __name__ == "__main__":
    main()
