"""SSH benchmark: a 2-host x 2-rank mesh on network-namespace test hosts (needs root).

Compares, in one run: startup, no-op broadcast round trip, 64 MiB push/pull and a call between the
actors of two proc meshes (one on each host) of the SSH mesh, next to a local 4-rank mesh, with plain
OpenSSH transfers of the same bytes (`ssh host cat > /dev/null`, `ssh host head -c`) as the floor,
and PyTorch Monarch's same call between proc meshes on the same two hosts (its workers started in the
hosts' network namespaces on its own TCP transport; from `.cache/monarch-venv`, which
scripts/test.sh makes). The call between proc meshes is measured twice: as it runs (after the first
call, straight between the ranks: rank/far_calls.py) and with every call through the controller, as
before that link existed.

    sudo .venv/bin/python benchmarks/bench_ssh.py [--quick]
"""

from __future__ import annotations

import argparse
import json
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
MONARCH_PYTHON = os.path.join(HERE, "..", ".cache", "monarch-venv", "bin", "python")
MONARCH_PORT = 26600  # each test host's own network namespace: no clash
MONARCH_CLIENT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from common import cross_mesh_times
from monarch import actor as api
api.enable_transport(f"tcp://{sys.argv[2]}:0")  # (the bridge's address: the hosts reach the client there)
hosts = api.attach_to_workers(ca="trust_all_connections", workers=sys.argv[4:])
procs_a = hosts.slice(hosts=0).spawn_procs(per_host={"gpus": 1})
procs_b = hosts.slice(hosts=len(sys.argv[4:]) - 1).spawn_procs(per_host={"gpus": 1})
print(json.dumps(cross_mesh_times(api, procs_a, procs_b, 200, int(sys.argv[3]))), flush=True)
os._exit(0)
"""
CROSS = "actor -> actor of another proc mesh (per call)"
CROSS_LONG = "the same, through the controller (no direct link)"
SAME_MESH = "actor -> actor of its own mesh on the last host (per call)"
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
        res[CROSS_LONG] = _cross_mesh(mesh, quick, direct=False)
        res[SAME_MESH] = _same_mesh(mesh, quick)
    finally:
        mesh.shutdown()
    return res


def _cross_mesh(mesh, quick: bool, direct: bool = True) -> list[float]:
    """An actor of a proc mesh on the first host calling an actor of one on the last host (Monarch's API);
    direct=False: the controller never tells the caller where the called ranks listen (every call goes
    through it, as before rank/far_calls.py), for the same-run before/after."""
    from monarch_kernel.controller.bridge import BRIDGE
    from monarch_kernel.monarch import actor as api

    if not direct:
        BRIDGE._route_directly = lambda *args: None  # (an instance attribute: the class's method is untouched)

    host_mesh = mesh.host_mesh()
    last = host_mesh.extent["hosts"] - 1
    procs_a = host_mesh.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, dist="none")
    procs_b = host_mesh.slice(hosts=last).spawn_procs(per_host={"gpus": 1}, dist="none")
    try:
        return cross_mesh_times(api, procs_a, procs_b, 200, 3 if quick else 8)
    finally:
        procs_a.stop()
        procs_b.stop()
        BRIDGE.__dict__.pop("_route_directly", None)


def _same_mesh(mesh, quick: bool) -> list[float]:
    """An actor on the first rank calling the actor of the same actor mesh on the last host's first rank."""
    from monarch_kernel.monarch import actor as api

    class Pong(api.Actor):
        @api.endpoint
        async def ping(self, x: int) -> int:
            return x

    class Ping(api.Actor):
        @api.endpoint
        async def relay(self, pongs, last: int, count: int) -> None:
            there = pongs.slice(hosts=last, gpus=0)
            for i in range(count):
                await there.ping.call_one(i)

    last = mesh.shape.sizes["hosts"] - 1
    pongs, pings = mesh.spawn("same_pong", Pong), mesh.spawn("same_ping", Ping)
    one = pings.slice(hosts=0, gpus=0)
    for _ in range(3):  # (the first calls go through the controller, which then says where the others listen)
        one.relay.call_one(pongs, last, 10).get()
    calls = 200
    return [t / calls for t in timed(lambda: one.relay.call_one(pongs, last, calls).get(), 3 if quick else 8, 1)]


def measure_attach(hosts: list[str], options: dict, quick: bool) -> list[float]:
    """A persistent mesh left by a kernel, attached (and a first cell run) by fresh interpreters, each timed."""
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


def measure_monarch(hosts, quick: bool) -> dict:
    """PyTorch Monarch's ping-pong between proc meshes on the first and the last test host."""
    import socket

    if not os.path.exists(MONARCH_PYTHON):
        return {"skipped": "no .cache/monarch-venv (scripts/test.sh installs torchmonarch there)"}
    workers, started = [], []
    serve = ("import sys; from monarch.actor import run_worker_loop_forever as serve; "
             "serve(ca='trust_all_connections', address=sys.argv[1])")
    try:
        for host in hosts.hosts:
            address = f"tcp://{host.address}:{MONARCH_PORT}"
            workers.append(address)
            started.append(subprocess.Popen(["ip", "netns", "exec", host.netns, MONARCH_PYTHON, "-c", serve, address],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for host in hosts.hosts:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection((host.address, MONARCH_PORT), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return {"skipped": f"Monarch's worker on {host.alias} did not listen within 60 s"}
                    time.sleep(0.2)
        done = subprocess.run([MONARCH_PYTHON, "-c", MONARCH_CLIENT, HERE, "198.18.0.1", "3" if quick else "8", *workers],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return {"skipped": f"Monarch's client failed: {done.stderr.strip().splitlines()[-1:]}"}
        return {CROSS: json.loads(done.stdout.strip().splitlines()[-1])}
    finally:
        for process in started:
            process.kill()
            process.wait()


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
            "PyTorch Monarch": measure_monarch(hosts, args.quick),
        }
        results["local 1x4"][ATTACH] = measure_attach([], {}, args.quick)
        results["ssh 2x2"][ATTACH] = measure_attach([h.alias for h in hosts.hosts], hosts.connect_options(), args.quick)
    finally:
        hosts.stop()
    ours = {"ssh 2x2": results.pop("ssh 2x2")}  # the first column is the one compared
    print(report({**ours, **results}, ["startup", "no-op broadcast", "pull 64 MiB", "push 64 MiB to all", CROSS, CROSS_LONG,
                                             SAME_MESH, ATTACH],
                 "benchmark", _fmt))
    print("\n(push to all: the time until every rank of the mesh has the tensor; the floor sends it once. "
          "Proc meshes: on the first and the last host of the mesh, Monarch's ping-pong; PyTorch Monarch's "
          "column runs the same program on the same two hosts with its own workers; its same-host figure is in "
          "bench_actors.py. Attach: a persistent mesh left by a kernel that "
          "ended, taken back by a fresh interpreter with a first cell (one new SSH connection per host); "
          "bench_persist.py compares it with IPython Parallel)")


def _fmt(seconds: float, row: str) -> str:
    return f"{MIB64 / seconds / 1e9:.2f} GB/s" if "64 MiB" in row else format_seconds(seconds)


if __name__ == "__main__":
    main()
