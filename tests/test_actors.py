"""Actors on local meshes: every way to call them, ordering, errors, death, cancellation."""

import asyncio
import io
import os
import signal
import sys
import threading
import time
import warnings

import cloudpickle
import pytest
from conftest import wait_until

from monarch_kernel import (
    Actor,
    ActorDiedError,
    ActorError,
    MeshInterrupted,
    MeshTimeoutError,
    MeshUsageError,
    RemoteError,
    ValueMesh,
    current_rank,
    endpoint,
    local_mesh,
)
from monarch_kernel.api.sinks import PlainSink

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file


class Counter(Actor):
    def __init__(self, start=0):
        self.value = start
        self.seen = []
        self.born_at = current_rank()

    def reset_quietly(self):  # a plain method: not callable from other processes
        self.value = 0

    @endpoint
    def add(self, by=1):
        self.value += by
        return self.value

    @endpoint
    def record(self, sender, seq):
        self.seen.append((sender, seq))

    @endpoint
    def history(self):
        return list(self.seen)

    @endpoint
    def where(self):
        point = current_rank()
        return dict(point), point.rank, dict(self.born_at)

    @endpoint
    def fail(self, text):
        raise ValueError(f"bad input: {text}")

    @endpoint
    def sleep(self, seconds):
        time.sleep(seconds)
        return "slept"

    @endpoint
    async def nap(self, seconds):
        await asyncio.sleep(seconds)
        return "napped"

    @endpoint
    def pid(self):
        return os.getpid()

    @endpoint
    def say(self, text):
        print(text)
        print("on stderr", file=sys.stderr)

    @endpoint
    def checksum(self, tensor):
        return float(tensor.double().sum()), tuple(tensor.shape)


class Relay(Actor):
    """Calls other actors from its endpoints (actor-to-actor)."""

    def __init__(self, counters):
        self.counters = counters
        self.me = current_rank()["gpus"]  # (where it was spawned: calls through a slice count from 0)

    @endpoint
    def fan(self, by):
        others = [r for r in self.counters.ranks if r != current_rank().rank]
        return self.counters.slice(gpus=others).add.call(by).get().by_rank()

    @endpoint
    async def fan_async(self, by):
        values = await self.counters.add.call(by)
        return sorted(values.values())

    @endpoint
    async def ask_own_rank(self):
        mine = self.counters.slice(gpus=self.me)
        return await mine.add.call_one(0)

    @endpoint
    def ask_own_rank_blocking(self):
        mine = self.counters.slice(gpus=self.me)
        return mine.add.call_one(0).get()


@pytest.fixture(scope="module")
def mesh():
    m = local_mesh(gpus=4, dist="none", name=f"actors-{os.getpid()}")
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def counters(mesh):
    return mesh.spawn("counters", Counter, 10)


@pytest.fixture(scope="module")
def relays(mesh, counters):
    return mesh.spawn("relays", Relay, counters)


def busy_with(mesh, rank, label):
    """Whether a rank reports running this endpoint (its heartbeat says so)."""
    return (mesh.status()[rank].busy_with or "").startswith(label)


def test_call_returns_a_value_mesh_of_every_reply(counters):
    result = counters.where.call().get()
    assert isinstance(result, ValueMesh)
    assert result.shape == counters.shape
    for point, (coords, rank, born) in result.items():
        assert coords == dict(point) == born and rank == point.rank


def test_call_one_choose_and_slices(counters):
    one = counters.slice(hosts=0, gpus=2)
    before = one.add.call_one(0).get()
    assert one.add.call_one(5).get() == before + 5
    with pytest.raises(MeshUsageError, match="one-actor slice"):
        counters.add.call_one()
    chosen = {counters.pid.choose().get() for _ in range(8)}
    assert len(chosen) == 4  # round robin reaches every rank
    pair = counters.slice(gpus=slice(0, 2))
    assert pair.ranks == (0, 1)
    assert list(pair.where.call().get().by_rank()) == [0, 1]


def test_stream_yields_each_reply_as_it_arrives(counters):
    got = [(f.rank, f.get()) for f in counters.where.stream()]
    assert sorted(r for r, _ in got) == [0, 1, 2, 3]


def test_broadcast_runs_everywhere_and_reports_failures(counters, capfd):
    before = counters.add.call(0).get().by_rank()
    counters.add.broadcast(100)
    after = counters.add.call(0).get().by_rank()  # same sender: ordered after the broadcast
    assert all(after[r] == before[r] + 100 for r in before)
    counters.fail.broadcast("from broadcast")
    deadline = time.monotonic() + 5
    err = ""
    while time.monotonic() < deadline and err.count("bad input: from broadcast") < 4:
        time.sleep(0.05)
        err += capfd.readouterr().err
    assert err.count("broadcast Counter.fail failed on rank") == 4


def test_what_endpoints_print_shows_in_the_notebook_tagged_by_rank(counters, capfd):
    counters.slice(gpus=slice(1, 3)).say.call("hello from an actor").get()
    deadline = time.monotonic() + 5
    out = err = ""
    while time.monotonic() < deadline and not ("[rank 2] hello" in out and "[rank 2] on stderr" in err):
        time.sleep(0.05)
        captured = capfd.readouterr()
        out, err = out + captured.out, err + captured.err
    assert "[rank 1] hello from an actor\n" in out and "[rank 2] hello from an actor\n" in out
    assert "[rank 1] on stderr\n" in err


def test_await_in_an_event_loop_without_warnings(counters):
    async def main():
        value = await counters.slice(gpus=0).add.call_one(0)
        whole = await counters.add.call(0)
        blocking = counters.slice(gpus=1).add.call_one(0).get()  # sync use inside a loop
        return value, whole, blocking

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value, whole, blocking = asyncio.run(main())
    assert value == whole.item(hosts=0, gpus=0) and isinstance(blocking, int)


def test_each_sender_order_is_kept(counters):
    target = counters.slice(gpus=3)
    futures = [target.record.call_one("nb", i) for i in range(300)]
    for f in futures:
        f.get()
    seen = [seq for sender, seq in target.history.call_one().get() if sender == "nb"]
    assert seen == list(range(300))


def test_errors_name_actor_rank_endpoint_and_show_source(counters):
    with pytest.raises(ActorError) as info:
        counters.slice(gpus=slice(1, 3)).fail.call("oops").get()
    err = info.value
    assert err.ranks == [1, 2]
    text = str(err)
    assert "Actor call counters.fail failed on ranks 1-2 (Counter.fail)" in text  # (Monarch's words first)
    assert 'raise ValueError(f"bad input: {text}")' in text  # the source line itself
    assert "ValueError: bad input: oops" in text


def test_unknown_endpoint_and_bad_spawn(mesh, counters):
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        _ = counters.nope
    with pytest.raises(MeshUsageError, match="subclass of monarch_kernel.Actor"):
        mesh.spawn("x", dict)


def test_spawning_a_name_again_replaces_it_as_rerunning_a_cell_expects(mesh):
    first = mesh.spawn("rerun", Counter, 1)
    assert list(first.add.call(0).get().values()) == [1] * 4
    second = mesh.spawn("rerun", Counter, 100)  # the cell ran again (maybe with an edited class)
    assert list(second.add.call(0).get().values()) == [100] * 4
    assert list(mesh.run("actors['rerun'].value", sink=PlainSink(stream=io.StringIO())).values()) == [100] * 4
    with pytest.raises(ActorError, match="spawned again") as info:
        first.add.call(1).get()
    assert "use the one the new spawn() returned" in str(info.value)
    # a spawn over part of the ranks replaces only those; the old handle's others still serve
    third = mesh.slice(gpus=slice(0, 2)).spawn("rerun", Counter, 7)
    assert list(third.add.call(0).get().values()) == [7, 7]
    assert list(second.slice(gpus=slice(2, 4)).add.call(0).get().values()) == [100, 100]
    with pytest.raises(ActorError, match="spawned again"):
        second.slice(gpus=0).add.call_one(0).get()


def test_actor_meshes_of_one_name_on_disjoint_slices_live_side_by_side(mesh):
    parts = [mesh.slice(gpus=r).spawn("per-rank", Counter, r * 10) for r in range(4)]
    assert [p.add.call_one(1).get() for p in parts] == [1, 11, 21, 31]


def test_a_failing_constructor_is_a_readable_error(mesh):
    class Broken(Actor):
        def __init__(self):
            raise RuntimeError("cannot build")

    with pytest.raises(RemoteError, match="cannot build") as caught:
        mesh.spawn("broken", Broken)
    assert type(caught.value) is RemoteError and caught.value.failures[0].error_type == "RuntimeError"


def test_large_tensor_argument(counters):
    import torch

    t = torch.arange(16 * 1024 * 1024, dtype=torch.float32)  # 64 MiB
    result = counters.checksum.call(t).get()
    assert set(result.values()) == {(float(t.double().sum()), (16 * 1024 * 1024,))}
    # the ranks let go of the argument as their endpoints return; its file is then recycled, not left
    deadline = time.monotonic() + 10
    while leftovers := [n for n in os.listdir(mesh_shm_dir(counters)) if n.startswith(("buf-", "hold-"))]:
        assert time.monotonic() < deadline, leftovers
        time.sleep(0.02)


def mesh_shm_dir(actor_mesh):
    from monarch_kernel.wire.calls import find_sender

    return find_sender(actor_mesh.mesh_name).shm_dir_for(actor_mesh.ranks)


def test_an_awaiting_actor_does_not_hold_up_others_but_holds_its_own_queue(mesh, counters):
    sleepers = mesh.spawn("sleepers", Counter)
    napping = sleepers.nap.call(1.0)
    start = time.monotonic()
    counters.add.call(0).get(timeout=5)  # another actor on the same ranks answers at once
    assert time.monotonic() - start < 0.5
    queued = sleepers.add.call(0)  # the same actor serves one message at a time
    assert not queued._pending.wait(1, timeout=0.2)  # still queued behind the nap
    assert set(napping.get(timeout=5).values()) == {"napped"}
    assert set(queued.get(timeout=5).values()) == {0}


def test_actor_to_actor_calls(mesh, counters, relays):
    before = counters.add.call(0).get().by_rank()
    fanned = relays.slice(gpus=0).fan.call_one(1).get()  # a sync endpoint calls ranks 1-3
    assert fanned == {r: before[r] + 1 for r in (1, 2, 3)}
    values = relays.slice(gpus=1).fan_async.call_one(1).get()  # an async one awaits all four
    assert values == sorted(v + 1 + (r != 0) for r, v in before.items())
    # an async endpoint may await an actor on its own rank
    assert relays.ask_own_rank.call().get().by_rank() == counters.add.call(0).get().by_rank()
    # and so may a sync one: the rank serves its other actors while the endpoint waits
    assert relays.ask_own_rank_blocking.call().get(timeout=10).by_rank() == counters.add.call(0).get().by_rank()


def test_mesh_cells_see_the_actors_of_their_rank(mesh, counters):
    values = counters.add.call(0).get().by_rank()
    seen = mesh.run("actors['counters'].value").by_rank()
    assert seen == values
    ranks = mesh.run("from monarch_kernel import current_rank\ncurrent_rank().rank").by_rank()
    assert ranks == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_cell_and_an_actor_call_queued_behind_it_run_in_the_order_they_were_sent(mesh, counters):
    busy = mesh.run_async("import time\ntime.sleep(0.5)")  # both wait behind it, and are read together
    cell = mesh.run_async("actors['counters'].seen.append(('order', 'cell'))")
    call = counters.record.call("order", "call")
    for future in (busy, cell, call):
        future.get(timeout=20)
    for seen in counters.history.call().get().values():
        assert [what for sender, what in seen if sender == "order"][-2:] == ["cell", "call"]


def test_a_cell_may_call_actors_on_other_ranks_and_its_own(mesh, counters, relays):
    code = ("from monarch_kernel import current_rank\n"
            "others = actors['relays'].counters.slice(gpus=slice(1, 4))\n"
            "sorted(others.where.call().get().by_rank())")
    assert mesh.slice(gpus=0).run(code).item(hosts=0) == [1, 2, 3]
    # its own rank's sync actors are served while the cell waits
    everyone = mesh.slice(gpus=0).run("actors['relays'].counters.add.call(0).get(timeout=10).by_rank()")
    assert sorted(everyone.item(hosts=0)) == [0, 1, 2, 3]


def test_timeout_cancels_a_sync_endpoint_and_frees_the_actor(counters):
    target = counters.slice(gpus=1)
    start = time.monotonic()
    with pytest.raises(MeshTimeoutError, match="told to stop"):
        target.sleep.call_one(30).get(timeout=0.5)
    assert target.add.call_one(0).get(timeout=5) is not None
    assert time.monotonic() - start < 3


def test_timeout_cancels_an_async_endpoint(counters):
    target = counters.slice(gpus=2)
    with pytest.raises(MeshTimeoutError) as info:
        target.nap.call_one(30).get(timeout=0.3)
    assert info.value.failures and info.value.failures[0].kind == "interrupted"
    assert target.nap.call_one(0).get(timeout=5) == "napped"


def test_queued_calls_behind_a_cancelled_one_still_run(counters):
    target = counters.slice(gpus=0)
    slow = target.sleep.call_one(30)
    quick = target.add.call_one(0)
    with pytest.raises(MeshTimeoutError):
        slow.get(timeout=0.3)
    assert isinstance(quick.get(timeout=5), int)


def test_ctrl_c_while_waiting_interrupts_the_endpoint(counters):
    target = counters.slice(gpus=3)
    main = threading.main_thread().ident
    threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(MeshInterrupted) as info:
        target.sleep.call_one(30).get()
    assert time.monotonic() - start < 3
    assert "KeyboardInterrupt" in str(info.value)
    assert target.sleep.call_one(0).get(timeout=5) == "slept"


def test_rank_death_fails_its_calls_fast_and_others_keep_serving():
    with local_mesh(gpus=3, dist="none", name="actor-death") as mesh:
        counters = mesh.spawn("c", Counter)
        events = []
        seen = threading.Event()
        counters.on_failure(lambda event: (events.append(event), seen.set()))
        victim = counters.slice(gpus=1)
        pid = victim.pid.call_one().get()
        waiting = victim.sleep.call_one(30)
        assert wait_until(lambda: busy_with(mesh, 1, "Counter.sleep"), 10)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ActorDiedError, match="rank 1") as info:
            waiting.get(timeout=10)
        assert time.monotonic() - start < 1.0
        assert info.value.failures[0].kind == "died"
        # later calls fail at once on the dead rank; the others answer
        with pytest.raises(ActorDiedError) as later:
            counters.add.call(1).get(timeout=5)
        assert later.value.ranks == [1]
        assert later.value.partial.item(hosts=0, gpus=0) == 1
        assert counters.slice(gpus=2).add.call_one().get() == 2
        assert seen.wait(5)
        assert events[0].actor == "c" and events[0].rank == 1 and "died" in events[0].reason


def test_restart_fails_pending_calls_and_forgets_actors():
    with local_mesh(gpus=2, dist="none", name="actor-restart") as mesh:
        counters = mesh.spawn("c", Counter)
        pending = counters.slice(gpus=0).sleep.call_one(30)
        assert wait_until(lambda: busy_with(mesh, 0, "Counter.sleep"), 10)
        mesh.restart()
        with pytest.raises(ActorError, match="restarted"):
            pending.get(timeout=5)
        with pytest.raises(ActorError, match="no actor mesh 'c'"):
            counters.add.call().get(timeout=5)
        again = mesh.spawn("c", Counter, 5)
        assert set(again.add.call().get().values()) == {6}


def test_the_rank_refuses_methods_that_are_not_endpoints(mesh, counters):
    """A handle that names a plain method (forged, or from an older class) gets a clear refusal."""
    from monarch_kernel.actors.client import ActorMesh

    forged = ActorMesh(counters.mesh_name, counters.name, counters.class_name,
                       counters.endpoints | {"reset_quietly"}, counters.shape, counters.key)
    with pytest.raises(ActorError, match="only methods marked @endpoint") as caught:
        forged.slice(gpus=0).reset_quietly.call_one().get(timeout=10)
    assert caught.value.failures[0].error_type == "AttributeError"
    assert counters.slice(gpus=0).add.call_one(0).get(timeout=10) != 0  # it did not run
