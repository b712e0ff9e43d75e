"""Each actor its own unit: a sync endpoint may block on another actor of its own rank, cycles
are reported (not hung), interrupts still stop a blocked endpoint, and each sender's order holds."""

import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest
from conftest import wait_until

from monarch_kernel import Actor, ActorError, MeshInterrupted, MeshTimeoutError, current_rank, endpoint, local_mesh

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file


class Counter(Actor):
    def __init__(self):
        self.value = 0

    @endpoint
    def incr(self, by):
        self.value += by
        return self.value

    @endpoint
    def sleep(self, seconds):
        time.sleep(seconds)
        return "slept"

    @endpoint
    async def later(self):
        return "later"


class Caller(Actor):
    """Holds a handle to the Counter mesh, which has an actor on its own rank too."""

    def __init__(self, counters):
        self.counters = counters
        self.me = current_rank()["gpus"]  # (where it was spawned: calls through a slice count from 0)

    @endpoint
    def relay(self):  # a plain (sync) endpoint, as a new user writes it
        return self.counters.incr.call(1).get(timeout=20).by_rank()

    @endpoint
    def relay_slow(self, seconds):
        mine = self.counters.slice(gpus=self.me)
        return mine.sleep.call_one(seconds).get()

    @endpoint
    def wait_on_async(self):
        return self.counters.slice(gpus=self.me).later.call_one().get(timeout=10)


class LoopBlocker(Actor):
    """Async endpoints that block their actor's event loop: on an async endpoint of another actor of their rank,
    of their own actor, or until a file appears."""

    def __init__(self, counters):
        self.mine = counters.slice(gpus=current_rank()["gpus"])
        self.own = None

    @endpoint
    async def meet(self, own):
        self.own = own.slice(gpus=current_rank()["gpus"])

    @endpoint
    async def block(self):
        return self.mine.later.call_one().get(timeout=10)

    @endpoint
    async def block_self(self):
        return self.own.later.call_one().get(timeout=10)

    @endpoint
    async def later(self):
        return "later"

    @endpoint
    async def block_on_sync(self):
        return self.mine.incr.call_one(0).get(timeout=10)

    @endpoint
    async def hold_until(self, started, release):
        open(started, "w").close()
        while not os.path.exists(release):
            time.sleep(0.01)  # (blocks this actor's loop: no await)
        return "released"


class Ping(Actor):
    """Two of these on each rank call each other: a cycle."""

    def __init__(self):
        self.other = None

    @endpoint
    def meet(self, other):
        self.other = other.slice(**current_rank())  # (called on the whole mesh: this rank's partner, as Monarch's)

    @endpoint
    def ask(self):
        return self.other.answer_back.call_one().get(timeout=10)

    @endpoint
    def answer_back(self):
        return self.other.noop.call_one().get(timeout=10)

    @endpoint
    def noop(self):
        return "noop"


class Recorder(Actor):
    def __init__(self):
        self.log = []

    @endpoint
    def record(self, sender, i):
        self.log.append((sender, i))

    @endpoint
    def logged(self):
        return self.log


class Sender(Actor):
    def __init__(self, recorder):
        self.recorder = recorder.slice(gpus=0)

    @endpoint
    def send_many(self, count):
        me = current_rank().rank
        futures = [self.recorder.record.call_one(me, i) for i in range(count)]
        for future in futures:
            future.get(timeout=60)
        return count


class MixedSender(Actor):
    """Calls its own rank's recorder both alone and as part of a call to every rank."""

    def __init__(self, recorders):
        self.recorders = recorders
        self.me = current_rank()["gpus"]  # (where it was spawned: calls through a slice count from 0)

    @endpoint
    def send_mixed(self, count):
        mine = self.recorders.slice(gpus=self.me)
        futures = [(self.recorders if i % 2 else mine).record.call(99, i) for i in range(count)]
        for future in futures:
            future.get(timeout=60)


@pytest.fixture(scope="module")
def mesh():
    m = local_mesh(gpus=4, dist="none", name=f"concurrency-{os.getpid()}")
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def counters(mesh):
    return mesh.spawn("counters", Counter)


def test_a_sync_endpoint_blocks_on_an_actor_of_its_own_rank(mesh, counters):
    callers = mesh.spawn("callers", Caller, counters)
    before = counters.incr.call(0).get().by_rank()
    seen = callers.slice(gpus=0).relay.call_one().get(timeout=20)
    assert seen == {r: v + 1 for r, v in before.items()}  # rank 0's Counter answered rank 0's Caller
    everyone = callers.relay.call().get(timeout=30)  # every rank's Caller at once
    assert all(len(by_rank) == 4 for by_rank in everyone.values())


def test_actors_calling_each_other_in_a_cycle_are_reported_with_both_names(mesh):
    first, second = mesh.spawn("first", Ping), mesh.spawn("second", Ping)
    first.meet.call(second).get()
    second.meet.call(first).get()
    start = time.monotonic()
    with pytest.raises(ActorError, match="deadlock") as info:
        first.slice(gpus=1).ask.call_one().get(timeout=20)
    assert time.monotonic() - start < 10  # reported, not hung
    text = str(info.value) + " ".join(f.message for f in info.value.failures)
    assert "Ping.ask" in text and "Ping.answer_back" in text and "ActorDeadlockError" in text
    assert first.slice(gpus=1).noop.call_one().get(timeout=10) == "noop"  # both serve again


def test_an_actor_waiting_on_itself_is_told_so(mesh):
    pings = mesh.spawn("self_ping", Ping)
    pings.meet.call(pings).get()  # its "other" is itself
    with pytest.raises(ActorError, match="cannot wait on itself"):
        pings.slice(gpus=2).answer_back.call_one().get(timeout=20)


def test_a_sync_endpoint_waits_on_an_async_endpoint_of_the_same_rank(mesh, counters):
    callers = mesh.spawn("async_callers", Caller, counters)
    assert callers.slice(gpus=3).wait_on_async.call_one().get(timeout=20) == "later"  # the loop runs beside it


def test_an_async_endpoint_may_block_on_an_async_endpoint_of_another_actor_of_its_rank(mesh, counters):
    """As in Monarch, each async actor has an event loop of its own: blocking it holds that actor only."""
    blockers = mesh.spawn("loop_blockers", LoopBlocker, counters)
    assert blockers.slice(gpus=3).block.call_one().get(timeout=20) == "later"
    for _ in range(20):  # a sync endpoint runs on another thread: blocking the loop on it is slow, not a deadlock
        assert blockers.slice(gpus=3).block_on_sync.call_one().get(timeout=20) is not None


def test_an_async_endpoint_blocking_its_loop_on_its_own_actor_says_what_to_change(mesh, counters):
    blockers = mesh.spawn("self_blockers", LoopBlocker, counters)
    blockers.meet.call(blockers).get(timeout=20)
    with pytest.raises(ActorError, match="await") as info:
        blockers.slice(gpus=3).block_self.call_one().get(timeout=20)
    assert "blocks its actor's event loop" in str(info.value)
    assert blockers.slice(gpus=3).later.call_one().get(timeout=10) == "later"  # its loop serves it after


def test_an_async_actor_that_blocks_its_loop_holds_no_other_actor_of_its_rank(mesh, counters, tmp_path):
    """Monarch's: a sleep in an `async def` held every async actor of the rank, and the notebook's calls to its
    sync actors too (they are delivered on the rank's loop), until it ended."""
    blockers = mesh.spawn("holders", LoopBlocker, counters)
    started, release = tmp_path / "started", tmp_path / "release"
    held = blockers.slice(gpus=2).hold_until.call_one(str(started), str(release))
    try:
        assert wait_until(started.exists, 20)
        assert counters.slice(gpus=2).later.call_one().get(timeout=10) == "later"  # another async actor
        assert counters.slice(gpus=2).incr.call_one(0).get(timeout=10) is not None  # a sync one
        assert not held.done()
    finally:
        release.touch()
    assert held.get(timeout=20) == "released"


def test_a_blocked_sync_endpoint_stops_on_a_timeout_and_on_the_stop_button(mesh, counters):
    callers = mesh.spawn("slow_callers", Caller, counters)
    target = callers.slice(gpus=1)
    start = time.monotonic()
    with pytest.raises(MeshTimeoutError):
        target.relay_slow.call_one(30).get(timeout=0.5)
    assert time.monotonic() - start < 3
    assert counters.slice(gpus=1).incr.call_one(0).get(timeout=5) is not None  # both actors free again
    assert target.relay_slow.call_one(0).get(timeout=10) == "slept"

    main = threading.main_thread().ident
    threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()  # the stop button
    start = time.monotonic()
    with pytest.raises(MeshInterrupted, match="KeyboardInterrupt"):
        target.relay_slow.call_one(30).get()
    assert time.monotonic() - start < 3
    assert target.relay_slow.call_one(0).get(timeout=10) == "slept"


def test_each_senders_order_holds_with_four_senders_and_a_thousand_messages_each(mesh):
    recorder = mesh.spawn("recorder", Recorder)
    senders = mesh.spawn("senders", Sender, recorder)
    assert set(senders.send_many.call(1000).get(timeout=120).values()) == {1000}
    log = recorder.slice(gpus=0).logged.call_one().get(timeout=30)
    assert len(log) == 4000
    for sender in range(4):
        assert [i for s, i in log if s == sender] == list(range(1000))


def test_calls_to_the_own_rank_alone_and_with_others_keep_their_order(mesh):
    recorders = mesh.spawn("mixed_recorders", Recorder)
    mixed = mesh.spawn("mixed", MixedSender, recorders)
    mixed.slice(gpus=2).send_mixed.call_one(400).get(timeout=60)
    assert recorders.slice(gpus=2).logged.call_one().get(timeout=30) == [(99, i) for i in range(400)]
    assert recorders.slice(gpus=0).logged.call_one().get(timeout=30) == [(99, i) for i in range(1, 400, 2)]


class Napper(Actor):
    """Sync endpoints that hold their thread: asleep, or busy in Python."""

    @endpoint
    def nap(self, seconds):
        time.sleep(seconds)
        return threading.current_thread() is threading.main_thread()

    @endpoint
    def spin(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "spun"

    @endpoint
    def where(self):
        return threading.current_thread() is threading.main_thread()


def _stop_button_after(seconds):
    threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()


def test_sync_endpoints_of_two_actors_of_a_rank_run_at_the_same_time_one_on_its_own_thread(mesh):
    first, second = mesh.spawn("nap_first", Napper), mesh.spawn("nap_second", Napper)
    start = time.monotonic()
    on_main = first.slice(gpus=0).nap.call_one(1.0)
    beside = second.slice(gpus=0).nap.call_one(1.0)
    results = on_main.get(timeout=20), beside.get(timeout=20)
    assert time.monotonic() - start < 1.8  # at the same time, not one after the other
    assert sorted(results) == [False, True]  # one ran on the main thread, the other on its actor's thread
    assert first.slice(gpus=0).where.call_one().get(timeout=10) is True  # idle again: the main thread takes it


def test_the_stop_button_reaches_sync_endpoints_asleep_or_busy_on_their_actors_own_threads(mesh):
    holder, sleeper, spinner = (mesh.spawn(f"stop_{what}", Napper) for what in ("holder", "sleeper", "spinner"))
    held = holder.slice(gpus=1).nap.call_one(60)  # holds the main thread: the others run on their own threads
    for call in (sleeper.slice(gpus=1).nap, spinner.slice(gpus=1).spin):
        _stop_button_after(0.5)
        start = time.monotonic()
        with pytest.raises(MeshInterrupted, match="KeyboardInterrupt"):
            call.call_one(60).get()
        assert time.monotonic() - start < 4
    assert sleeper.slice(gpus=1).where.call_one().get(timeout=10) is False  # serves again, beside the main thread
    _stop_button_after(0.5)
    with pytest.raises(MeshInterrupted, match="KeyboardInterrupt"):
        held.get()
    assert holder.slice(gpus=1).where.call_one().get(timeout=10) is True


def test_a_timeout_and_the_mesh_interrupt_stop_an_endpoint_on_its_actors_own_thread(mesh):
    busy, other = mesh.spawn("own_busy", Napper), mesh.spawn("own_other", Napper)
    holder = busy.slice(gpus=2).nap.call_one(60)  # holds the main thread
    start = time.monotonic()
    with pytest.raises(MeshTimeoutError):
        other.slice(gpus=2).nap.call_one(60).get(timeout=0.5)
    assert time.monotonic() - start < 4
    assert other.slice(gpus=2).where.call_one().get(timeout=10) is False  # free again (main is still held)
    beside = other.slice(gpus=2).spin.call_one(60)
    deadline = time.monotonic() + 20
    while "while time.monotonic() < end" not in (text := mesh.slice(gpus=2).why().text()):  # (it runs now)
        assert time.monotonic() < deadline, text
    mesh.interrupt()  # whatever runs on the ranks: the main thread's endpoint and the one beside it
    for future in (holder, beside):
        with pytest.raises((MeshInterrupted, ActorError), match="KeyboardInterrupt"):
            future.get(timeout=10)
    assert other.slice(gpus=2).where.call_one().get(timeout=10) is True


def test_why_shows_an_endpoint_stuck_on_its_actors_own_thread_and_its_line(mesh):
    holder, stuck = mesh.spawn("why_holder", Napper), mesh.spawn("why_stuck", Napper)
    spinning = holder.slice(gpus=3).spin.call_one(60)  # holds rank 3's main thread
    asleep = stuck.slice(gpus=3).nap.call_one(60)  # so this one runs beside it
    deadline = time.monotonic() + 20
    while "time.sleep(seconds)" not in (text := mesh.why().text()):
        assert time.monotonic() < deadline, text
    assert "actor-why_stuck" in text and "while time.monotonic() < end" in text  # both threads, each at its line
    mesh.interrupt()  # whatever the ranks run, on any thread
    for future in (spinning, asleep):
        with pytest.raises(MeshInterrupted, match="KeyboardInterrupt"):
            future.get(timeout=10)


def test_a_call_sent_right_after_a_cell_or_a_call_ends_runs_on_the_main_thread(mesh):
    napper = mesh.spawn("after_request", Napper).slice(gpus=0)
    for _ in range(20):  # (the main thread counts as free from its result on: the next call is not sent elsewhere)
        mesh.run("pass")
        assert napper.where.call_one().get(timeout=10) is True
        assert napper.where.call_one().get(timeout=10) is True
