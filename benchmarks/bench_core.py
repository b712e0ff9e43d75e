"""Core benchmark: monarch-kernel vs IPython Parallel vs PyTorch Monarch vs Ray vs a raw socket floor.

Each system runs in its own subprocess (so runtimes do not disturb each other) with 4
workers, and reports raw timings as JSON; this script prints medians, p99 and ratios.
The raw floor also measures an in-process copy of 64 MiB (numpy's `copy()`), the bar a
pull from a rank on the same host is held to.

    python benchmarks/bench_core.py [--quick] [--only ours,raw,ipyparallel,monarch,ray]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GroupingSink, NullSink, benchmark_main, figure, timed, timed_together  # noqa: E402

WORKERS = 4
MIB64 = 64 << 20
LINES_CODE = "for i in range(1000):\n    print('line', i)"


# ------------------------------------------------------------------ systems


def _noop_actor():
    from monarch_kernel import Actor, endpoint

    class Noop(Actor):
        @endpoint
        def noop(self) -> None:
            return None

    return Noop


def bench_ours(quick: bool) -> dict:
    import torch

    import monarch_kernel

    Noop = _noop_actor()
    res: dict = {}
    startups = []
    for _ in range(1 if quick else 3):
        t = time.perf_counter()
        mesh = monarch_kernel.local_mesh(gpus=WORKERS, dist="gloo")
        mesh.run("import torch", sink=NullSink())
        startups.append(time.perf_counter() - t)
        mesh.shutdown()
    res["startup (import torch)"] = startups
    mesh = monarch_kernel.local_mesh(gpus=WORKERS, dist="gloo")
    res["restart"] = timed(lambda: (mesh.restart(), mesh.run("pass", sink=NullSink())), 1 if quick else 3, 0)
    n = 100 if quick else 500
    noop = mesh.spawn("bench_noop", Noop)  # the bar for a cell: an actor call to every rank
    sender = mesh._runtime.sender
    on_lanes = sender.request_lanes

    def through_the_agent() -> None:  # the path cells took before they used the lanes
        sender.request_lanes = lambda ranks: None
        try:
            mesh.run("pass", sink=NullSink())
        finally:
            sender.request_lanes = on_lanes

    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "monarch_kernel")
    from monarch_kernel.magics import current_registry

    current_registry().add(mesh)
    import monarch_kernel.api.sinks as sinks

    sinks.set_default_sink_factory(lambda options: NullSink())
    res.update(timed_together({"no-op broadcast (API)": lambda: mesh.run("pass", sink=NullSink()),
                               "our actor call to all 4 (API)": lambda: noop.noop.call().get(),
                               "no-op broadcast through the agent": through_the_agent,
                               "no-op broadcast (magic)": lambda: ip.run_cell_magic("mesh", "", "pass")}, 3 * n))
    mesh.run(f"import torch\nt = torch.randn({MIB64 // 4})", sink=NullSink())
    one = mesh.slice(gpus=0)
    res["pull 64 MiB (s)"] = timed(lambda: one.pull("t"), 5 if quick else 15, 2)
    x = torch.randn(MIB64 // 4)
    res["push 64 MiB to 4 (s)"] = timed(lambda: mesh.push(t=x), 5 if quick else 15, 2)
    import numpy as np

    block = np.ones(MIB64, dtype=np.uint8)  # the floor in this process, same run: one memcpy of the bytes
    res["copy 64 MiB in process (s)"] = timed(block.copy, 5 if quick else 15, 2)

    def lines():
        sink = GroupingSink(mesh.ranks)
        mesh.run(LINES_CODE, sink=sink)
        assert sink.text.count("\n") == 999, sink.text[-200:]  # 1,000 deduped lines

    res["4 x 1,000 lines shown"] = timed(lines, 10 if quick else 30, 3)
    ip.run_line_magic("unload_ext", "monarch_kernel")
    return res


def bench_ipyparallel(quick: bool) -> dict:
    import ipyparallel as ipp
    import numpy as np

    res: dict = {}
    t = time.perf_counter()
    cluster = ipp.Cluster(n=WORKERS, log_level=40)
    rc = cluster.start_and_connect_sync(activate=True)
    rc.wait_for_engines(WORKERS, timeout=120)
    view = rc[:]
    view.execute("import torch", block=True)
    res["startup (import torch)"] = [time.perf_counter() - t]
    try:
        n = 100 if quick else 300
        res["no-op broadcast (API)"] = timed(lambda: view.execute("pass", block=True), n, 10)
        from IPython.testing.globalipapp import start_ipython

        ip = start_ipython()
        view.block = True  # %px waits for the engines, as %%mesh does
        view.activate()  # registers %px on the running IPython
        res["no-op broadcast (magic)"] = timed(lambda: ip.run_cell_magic("px", "", "pass"), n, 10)
        view.execute(f"import torch\nt = torch.randn({MIB64 // 4})", block=True)
        res["pull 64 MiB (s)"] = timed(lambda: rc[0].pull("t", block=True), 5 if quick else 15, 2)
        x = np.random.rand(MIB64 // 8)
        res["push 64 MiB to 4 (s)"] = timed(lambda: view.push({"t": x}, block=True), 5 if quick else 15, 2)

        def lines():
            ar = view.execute(LINES_CODE, block=True)
            assert sum(s.count("\n") for s in ar.stdout) == 4000

        res["4 x 1,000 lines shown"] = timed(lines, 10 if quick else 30, 3)
        t = time.perf_counter()
        cluster.restart_engines_sync()
        rc.wait_for_engines(WORKERS, timeout=120, block=True)
        rc[:].execute("import torch", block=True)
        res["restart"] = [time.perf_counter() - t]
    finally:
        cluster.stop_cluster_sync()
    return res


def bench_monarch(quick: bool) -> dict:
    import torch
    from monarch.actor import Actor, endpoint, this_host

    class Worker(Actor):
        def __init__(self):
            import torch as _t  # noqa: F401

        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def make(self, n: int) -> None:
            self.t = torch.randn(n)

        @endpoint
        def get(self):
            return self.t

        @endpoint
        def put(self, t) -> None:
            self.t = t

    res: dict = {}
    t = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"gpus": WORKERS})
    actors = procs.spawn("w", Worker)
    actors.noop.call().get()
    res["startup (import torch)"] = [time.perf_counter() - t]
    n = 100 if quick else 300
    res["no-op broadcast (API)"] = timed(lambda: actors.noop.call().get(), n, 10)
    actors.make.call(MIB64 // 4).get()
    one = actors.slice(gpus=0)
    res["pull 64 MiB (s)"] = timed(lambda: one.get.call_one().get(), 5 if quick else 15, 2)
    x = torch.randn(MIB64 // 4)
    res["push 64 MiB to 4 (s)"] = timed(lambda: actors.put.call(x).get(), 5 if quick else 15, 2)
    return res


def bench_ray(quick: bool) -> dict:
    """Ray with 4 actors: a pull is `ray.get` of an array an actor returned (zero-copy from its
    shared-memory store); a push is one `ray.put` that every actor then gets."""
    import numpy as np
    import ray

    res: dict = {}
    t = time.perf_counter()
    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

    @ray.remote
    class Worker:
        def __init__(self):
            import torch  # noqa: F401 - as every system's startup row imports torch

            self.block = np.ones(MIB64, dtype=np.uint8)

        def ping(self):
            return None

        def pull(self):
            return self.block

        def touch(self, array):
            return int(array[-1])

    actors = [Worker.remote() for _ in range(WORKERS)]
    try:
        ray.get([a.ping.remote() for a in actors])
        res["startup (import torch)"] = [time.perf_counter() - t]
        n = 100 if quick else 500
        res["no-op broadcast (API)"] = timed(lambda: ray.get([a.ping.remote() for a in actors]), n, 20)
        res["pull 64 MiB (s)"] = timed(lambda: ray.get(actors[0].pull.remote()), 5 if quick else 15, 2)
        x = np.ones(MIB64, dtype=np.uint8)

        def push():
            ref = ray.put(x)
            ray.get([a.touch.remote(ref) for a in actors])

        res["push 64 MiB to 4 (s)"] = timed(push, 5 if quick else 15, 2)
    finally:
        ray.shutdown()
    return res


def bench_raw(quick: bool) -> dict:
    """The floor: a parent and 4 children on bare Unix socketpairs.

    No framing, no serialization, 1-byte messages for the broadcast; 64 MiB moves
    into a freshly allocated buffer, as any system must hand back a new object.
    """
    import socket

    socks, pids = [], []
    for _ in range(WORKERS):
        a, b = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            a.close()
            _raw_child(b)
            os._exit(0)
        b.close()
        socks.append(a)
        pids.append(pid)

    def bcast():
        for s in socks:
            s.sendall(b"p")
        for s in socks:
            s.recv(1)

    res: dict = {"no-op broadcast (API)": timed(bcast, 200 if quick else 1000, 50)}

    def pull():
        # a fresh buffer each time: a pull must hand the caller a new object, as every system does
        buf = bytearray(MIB64)
        socks[0].sendall(b"g")
        view, got = memoryview(buf), 0
        while got < MIB64:
            got += socks[0].recv_into(view[got:])

    res["pull 64 MiB (s)"] = timed(pull, 5 if quick else 15, 2)
    import numpy as np

    block = np.ones(MIB64, dtype=np.uint8)
    res["copy 64 MiB in process (s)"] = timed(block.copy, 5 if quick else 15, 2)
    data = bytes(MIB64)

    def push():
        for s in socks:
            s.sendall(b"s")
            s.sendall(data)
        for s in socks:
            s.recv(1)

    res["push 64 MiB to 4 (s)"] = timed(push, 5 if quick else 15, 2)
    for s in socks:
        s.sendall(b"q")
    for pid in pids:
        os.waitpid(pid, 0)
    return res


def _raw_child(sock) -> None:
    payload = bytes(MIB64)
    while True:
        cmd = sock.recv(1)
        if cmd in (b"q", b""):
            return
        if cmd == b"p":
            sock.sendall(b"r")
        elif cmd == b"g":
            sock.sendall(payload)
        elif cmd == b"s":
            buf = bytearray(MIB64)
            view, got = memoryview(buf), 0
            while got < MIB64:
                got += sock.recv_into(view[got:])
            sock.sendall(b"k")


SYSTEMS = {"ours": bench_ours, "raw": bench_raw, "ipyparallel": bench_ipyparallel, "monarch": bench_monarch,
           "ray": bench_ray}
ROWS = ["startup (import torch)", "restart", "no-op broadcast (API)", "our actor call to all 4 (API)",
        "no-op broadcast through the agent", "no-op broadcast (magic)",
        "pull 64 MiB (s)", "push 64 MiB to 4 (s)", "copy 64 MiB in process (s)", "4 x 1,000 lines shown"]


# ------------------------------------------------------------------ driver


def main() -> None:
    """Run every system (or --only some) and print the comparison."""
    benchmark_main(__file__, SYSTEMS, ROWS, 'benchmark (4 workers)', figure,
                   "(ratios: our median time divided by the peer's; below 1.00x means we are faster; "
                   "for the 64 MiB rows the figures are throughput)")


if __name__ == "__main__":
    main()
