"""Stops at random moments on a machine whose CPUs are oversubscribed (issue 41).

Two busy-loop processes per core run beside a 4-rank gloo mesh, as dataloader workers do on a
GPU node. Each round starts one kind of work that does not end by itself (a sleep, a busy loop,
a collective that rank 3 never joins, an actor endpoint, an endpoint waiting on a call to an actor of
its own rank, which its wait serves on the same thread, a background cell), stops it at a random
moment (the stop button's SIGINT on the waiting thread, or `mesh.interrupt()` for the background
cell), and checks: the stop ends it within STOP_WITHIN_S as an interrupt; the next cell is "ok",
prints what it should on every rank and runs a collective; and every piece of work ran at most
once on each rank, every follow-up cell exactly once (each counts itself on the ranks).

The seed is fixed so CI replays the same storm; MONARCH_STOP_STORM_SEED sets another.
"""

import io
import multiprocessing
import os
import random
import signal
import sys
import threading
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, MeshInterrupted, current_rank, endpoint, local_mesh
from monarch_kernel.api.sinks import PlainSink

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("MONARCH_STOP_STORM_ROUNDS", "20"))
SEED = int(os.environ.get("MONARCH_STOP_STORM_SEED", "20261203"))
STOP_WITHIN_S = 5.0
KINDS = ("sleep", "busy", "collective", "actor", "background", "relay")

COUNT = "ran.setdefault({token!r}, 0)\nran[{token!r}] += 1\n"  # first thing each piece of work does
WORK = {
    "sleep": "import time\ntime.sleep(120)\n",
    "busy": "while True:\n    pass\n",
    "collective": ("import time, torch, torch.distributed as dist\nif dist.get_rank() == 3:\n    time.sleep(120)\n"
                   "dist.all_reduce(torch.ones(4))\n"),
    "background": ("import time, torch, torch.distributed as dist\nif dist.get_rank() == 3:\n    while True:\n"
                   "        time.sleep(0.01)\ndist.all_reduce(torch.ones(4))\n"),  # (nobody waits on it: %mesh interrupt)
}


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (the ranks cannot import the tests' folder)


class Sleeper(Actor):
    """An endpoint that does not end by itself, counting its runs on the rank."""

    def __init__(self) -> None:
        self.ran: dict[str, int] = {}

    @endpoint
    def hang(self, token: str) -> None:
        self.ran[token] = self.ran.get(token, 0) + 1
        time.sleep(120)

    @endpoint
    def runs(self) -> dict[str, int]:
        return dict(self.ran)


class Relay(Actor):
    """An endpoint that waits on its own rank's Sleeper (its wait serves that call itself, on its thread)."""

    def __init__(self, sleepers) -> None:
        self.mine = sleepers.slice(gpus=current_rank()["gpus"])

    @endpoint
    def through(self, token: str) -> None:
        self.mine.hang.call_one(token).get()


def _spin() -> None:
    while True:
        pass


@pytest.fixture
def oversubscribed():
    """Two busy-loop processes per core, for the whole test."""
    spinners = [multiprocessing.get_context("fork").Process(target=_spin, daemon=True)
                for _ in range(2 * (os.cpu_count() or 1))]
    for p in spinners:
        p.start()
    try:
        yield len(spinners)
    finally:
        for p in spinners:
            p.kill()
            p.join(10)


def _sigint_main_after(seconds: float) -> threading.Timer:
    """The stop button: SIGINT to this process's main thread after `seconds`."""
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    return timer


def test_stops_at_random_moments_on_a_busy_machine_each_end_their_own_work_and_only_it(oversubscribed):
    rng = random.Random(SEED)
    problems: list[str] = []
    out = io.StringIO()
    with local_mesh(gpus=4, dist="gloo", name=f"stops-{os.getpid()}") as mesh:
        mesh.hang_after_s = None  # (the verdicts are another test's: here only the stops)
        mesh.run("ran = {}", sink=PlainSink(out))
        sleepers = mesh.spawn("sleepers", Sleeper)
        relays = mesh.spawn("relays", Relay, sleepers)
        followups = []
        for n in range(ROUNDS):
            kind = KINDS[n % len(KINDS)] if n < len(KINDS) else rng.choice(KINDS)
            token, delay = f"{kind}-{n}", rng.uniform(0.0, 0.6)
            stopped_at = None
            try:
                if kind == "background":
                    future = mesh.run_async(COUNT.format(token=token) + WORK[kind], sink=PlainSink(out))
                    time.sleep(delay)  # (the random moment; the work never ends by itself)
                    stopped_at = time.monotonic()
                    mesh.interrupt()
                    future.get(timeout=STOP_WITHIN_S)
                else:
                    timer = _sigint_main_after(delay)
                    stopped_at = time.monotonic() + delay
                    try:
                        if kind == "actor":
                            sleepers.hang.call(token).get()
                        elif kind == "relay":
                            relays.through.call(token).get()
                        else:
                            mesh.run(COUNT.format(token=token) + WORK[kind], sink=PlainSink(out))
                    finally:
                        timer.join()
                problems.append(f"round {n} ({kind}): the work ended without the stop")
            except KeyboardInterrupt as exc:  # MeshInterrupted, or the plain one when it came before the send
                took = time.monotonic() - (stopped_at or time.monotonic())
                if took > STOP_WITHIN_S:
                    problems.append(f"round {n} ({kind}): the stop took {took:.1f} s")
                if kind == "background" and not isinstance(exc, MeshInterrupted):
                    problems.append(f"round {n} ({kind}): {type(exc).__name__} instead of MeshInterrupted")
            except Exception as exc:  # noqa: BLE001 - any other outcome is a problem of this round
                problems.append(f"round {n} ({kind}): {type(exc).__name__}: {exc}")
            followup = f"next-{n}"
            followups.append(followup)
            try:
                values = mesh.run(COUNT.format(token=followup) + "import torch, torch.distributed as dist\n"
                                  "t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), " + repr(followup) + ")",
                                  sink=PlainSink(out), timeout=60)
                if list(values.values()) != [(4.0, followup)] * 4:
                    problems.append(f"round {n} ({kind}): the next cell gave {list(values.values())}")
            except BaseException as exc:  # noqa: BLE001 - a stop that landed in the next cell shows here
                problems.append(f"round {n} ({kind}): the next cell failed: {type(exc).__name__}: {exc}")
        cells = mesh.run("ran", sink=PlainSink(out), timeout=60).by_rank()
        actors = sleepers.runs.call().get(timeout=60).by_rank()
        for rank in range(4):
            counts = dict(cells[rank])
            for token, times in {**counts, **actors[rank]}.items():
                if times > 1:
                    problems.append(f"rank {rank}: {token} ran {times} times")
            for followup in followups:
                if counts.get(followup) != 1:
                    problems.append(f"rank {rank}: {followup} ran {counts.get(followup, 0)} times, not once")
    assert not problems, (f"stop storm (seed {SEED}, {oversubscribed} busy loops beside the mesh):\n"
                          + "\n".join(problems))


def test_a_stop_as_a_cell_is_sent_never_runs_it_twice_and_stops_it_on_every_rank():
    """The stop button lands just as a cell's bytes went out to rank 0 (before, rank 0 got the cell again
    with the next one, and nobody stopped it); then the next cell runs once everywhere."""
    import socket

    from conftest import wait_until
    from test_interrupt_shield import StoppedAsItReturns

    out = PlainSink(io.StringIO())
    with local_mesh(gpus=2, name=f"shield-{os.getpid()}") as mesh:
        mesh.run("ran = []", sink=out)
        lanes = mesh._runtime.sender.lanes
        lane = lanes.get(0)
        stopped = StoppedAsItReturns(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(lane.sock.fileno()))
        stopped.setblocking(False)
        stopped.stop_on = "send"
        lane.sock = stopped
        with pytest.raises(KeyboardInterrupt):
            mesh.run("import time\nran.append('first')\ntime.sleep(30)", sink=out)
        assert wait_until(lambda: all(s.busy_with is None for s in mesh.status()), 10)
        mesh.run("ran.append('second')", sink=out)
        runs = mesh.run("ran", sink=out).by_rank()
        for rank, ran in runs.items():  # the first ran at most once (it may have been stopped before it began)
            assert ran in (["first", "second"], ["second"]), (rank, ran)
