"""Actor benchmark: monarch-kernel actors vs Ray actors vs PyTorch Monarch vs a raw socket floor.

Four local workers each; every system runs in its own subprocess and reports raw
timings as JSON; this script prints medians, p99 and ratios.

    python benchmarks/bench_actors.py [--quick] [--only ours,raw,ray,monarch]

Rows: a call_one round trip (one small argument, one small reply), a call to all 4,
1,000 calls in flight to one actor (reported as calls per second), a call to one
actor with a 64 MiB float32 tensor argument (reported as GB/s), and a plain (sync)
endpoint that calls another actor and waits, per call: one on its own rank (ours: served
by the rank while the endpoint waits) and one on another rank (Ray: another actor process);
and, with Monarch's API on both, an async endpoint of an actor on one proc mesh awaiting calls to
an actor on another proc mesh of the same host (Monarch's ping-pong), per call.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import benchmark_main, cross_mesh_times, figure, timed  # noqa: E402

WORKERS = 4
PIPELINED = 1000
MIB64 = 64 << 20
CROSS = "actor -> actor of another proc mesh"
ROWS = ["call_one round trip", "call to all 4", "pipelined calls/s (1,000 in flight)",
        "64 MiB tensor argument", "sync actor -> actor, same rank", "sync actor -> actor, other rank", CROSS]
RELAYED = 200  # calls a relaying endpoint makes per measurement


def _counts(quick: bool) -> tuple[int, int, int]:
    """(round trips, pipelined batches, tensor calls)."""
    return (200, 5, 5) if quick else (1000, 20, 15)


def _measure(call_one, call_all, pipelined, tensor_call, quick: bool) -> dict:
    n, batches, tensors = _counts(quick)
    return {
        "call_one round trip": timed(call_one, n, 50),
        "call to all 4": timed(call_all, n, 50),
        "pipelined calls/s (1,000 in flight)": timed(pipelined, batches, 2),
        "64 MiB tensor argument": timed(tensor_call, tensors, 2),
    }


def _cross_mesh(actor_module, quick: bool) -> list[float]:
    """Per-call times of an actor on one proc mesh calling an actor on another of this host."""
    procs_a = actor_module.this_host().spawn_procs(per_host={"gpus": 1})
    procs_b = actor_module.this_host().spawn_procs(per_host={"gpus": 1})
    return cross_mesh_times(actor_module, procs_a, procs_b, RELAYED, 5 if quick else 15)


def _measure_actor_mesh(actors, quick: bool) -> dict:
    """The four rows for an actor mesh with Monarch's API (ours and Monarch's share it)."""
    import torch

    one = actors.slice(gpus=0)
    t = torch.randn(MIB64 // 4)
    return _measure(
        lambda: one.ping.call_one(1).get(),
        lambda: actors.ping.call(1).get(),
        lambda: [f.get() for f in [one.ping.call_one(i) for i in range(PIPELINED)]],
        lambda: one.nbytes.call_one(t).get(),
        quick)


# ------------------------------------------------------------------ systems


def bench_ours(quick: bool) -> dict:
    from monarch_kernel import Actor, endpoint, local_mesh

    class Echo(Actor):
        @endpoint
        def ping(self, x):
            return x

        @endpoint
        def nbytes(self, t):
            return t.numel()

    class Relay(Actor):
        def __init__(self, echo):
            self.echo = echo

        @endpoint
        def relay(self, rank, count):
            target = self.echo.slice(gpus=rank)
            for i in range(count):
                target.ping.call_one(i).get()

    mesh = local_mesh(gpus=WORKERS, dist="none")
    try:
        echo = mesh.spawn("echo", Echo)
        res = _measure_actor_mesh(echo, quick)
        relay = mesh.spawn("relay", Relay, echo).slice(gpus=0)
        n = 5 if quick else 15
        for row, rank in (("sync actor -> actor, same rank", 0), ("sync actor -> actor, other rank", 1)):
            res[row] = [t / RELAYED for t in timed(lambda r=rank: relay.relay.call_one(r, RELAYED).get(), n, 1)]
        from monarch_kernel.monarch import actor as our_monarch_api

        res[CROSS] = _cross_mesh(our_monarch_api, quick)
        return res
    finally:
        mesh.shutdown()


def bench_ray(quick: bool) -> dict:
    import ray
    import torch

    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

    @ray.remote
    class Echo:
        def ping(self, x):
            return x

        def nbytes(self, t):
            return t.numel()

    @ray.remote
    class Relay:
        def __init__(self, echo):
            self.echo = echo

        def relay(self, count):
            for i in range(count):
                ray.get(self.echo.ping.remote(i))

    actors = [Echo.remote() for _ in range(WORKERS)]
    ray.get([a.ping.remote(0) for a in actors])
    t = torch.randn(MIB64 // 4)
    try:
        res = _measure(
            lambda: ray.get(actors[0].ping.remote(1)),
            lambda: ray.get([a.ping.remote(1) for a in actors]),
            lambda: ray.get([actors[0].ping.remote(i) for i in range(PIPELINED)]),
            lambda: ray.get(actors[0].nbytes.remote(t)),
            quick)
        relay = Relay.remote(actors[1])  # each Ray actor is its own process: every call is "another rank"
        ray.get(relay.relay.remote(1))
        res["sync actor -> actor, other rank"] = [
            t / RELAYED for t in timed(lambda: ray.get(relay.relay.remote(RELAYED)), 5 if quick else 15, 1)]
        return res
    finally:
        ray.shutdown()


def bench_monarch(quick: bool) -> dict:
    from monarch.actor import Actor, endpoint, this_host

    class Echo(Actor):
        @endpoint
        def ping(self, x: int) -> int:
            return x

        @endpoint
        def nbytes(self, t) -> int:
            return t.numel()

    import monarch.actor

    procs = this_host().spawn_procs(per_host={"gpus": WORKERS})
    actors = procs.spawn("echo", Echo)
    actors.ping.call(0).get()
    res = _measure_actor_mesh(actors, quick)
    res[CROSS] = _cross_mesh(monarch.actor, quick)
    return res


_LEN = struct.Struct("!Q")


def bench_raw(quick: bool) -> dict:
    """The floor: 4 forked children on Unix socketpairs, length-prefixed pickles.

    The child unpickles (method, args), calls, pickles the reply: the least any actor
    system must do. The tensor row sends the raw 64 MiB into a fresh buffer.
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
    files = [s.makefile("rb") for s in socks]

    def frame(obj) -> bytes:
        data = pickle.dumps(obj, protocol=5)
        return _LEN.pack(len(data)) + data

    def send(sock, obj):
        sock.sendall(frame(obj))

    def recv(f):
        (n,) = _LEN.unpack(f.read(_LEN.size))
        return pickle.loads(f.read(n))

    def call_all():
        for s in socks:
            send(s, ("ping", 1))
        return [recv(f) for f in files]

    def pipelined():
        # one write for the whole batch: one call per message could fill both socket
        # buffers (requests one way, replies the other) and deadlock
        socks[0].sendall(b"".join(frame(("ping", i)) for i in range(PIPELINED)))
        return [recv(files[0]) for _ in range(PIPELINED)]

    payload = bytes(MIB64)

    def tensor_call():
        socks[0].sendall(_LEN.pack(0) + _LEN.pack(MIB64))
        socks[0].sendall(payload)
        return recv(files[0])

    try:
        return _measure(lambda: (send(socks[0], ("ping", 1)), recv(files[0])), call_all, pipelined,
                        tensor_call, quick)
    finally:
        for closable in (*files, *socks):
            closable.close()
        for pid in pids:
            os.waitpid(pid, 0)


def _raw_child(sock) -> None:
    f = sock.makefile("rb")
    while True:
        head = f.read(_LEN.size)
        if len(head) < _LEN.size:
            return
        (n,) = _LEN.unpack(head)
        if n == 0:  # a raw buffer follows
            (size,) = _LEN.unpack(f.read(_LEN.size))
            buf = bytearray(size)
            f.readinto(buf)
            reply = len(buf) // 4
        else:
            method, arg = pickle.loads(f.read(n))
            reply = arg
        data = pickle.dumps(reply, protocol=5)
        sock.sendall(_LEN.pack(len(data)) + data)


SYSTEMS = {"ours": bench_ours, "raw": bench_raw, "ray": bench_ray, "monarch": bench_monarch}


def main() -> None:
    """Run every system (or --only some) and print the comparison."""
    benchmark_main(__file__, SYSTEMS, ROWS, 'actor benchmark (4 workers)',
                   lambda seconds, row: figure(seconds, row, per_run=PIPELINED, counted="pipelined"),
                   "(ratios: our median time divided by the peer's; below 1.00x means we are faster; "
                   "pipelined and 64 MiB rows show throughput, their ratios are still of time)")


if __name__ == "__main__":
    main()
