"""Monarch's API (`monarch_kernel.monarch.actor`): Monarch-style programs run with the import changed.

The programs in tests/programs/monarch/ are written as for PyTorch Monarch (`from monarch.actor
import ...`); each test changes only their import lines and runs them as a script.
"""

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest
from conftest import wait_until

from monarch_kernel import MeshUsageError
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.monarch.actor import Actor, Channel, Port, SupervisionError, endpoint, this_host

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file
PROGRAMS = Path(__file__).parent / "programs" / "monarch"
IMPORT = re.compile(r"^(from|import) monarch\.actor\b", re.M)


def with_our_import(source: str) -> str:
    """The program with `monarch.actor` imports pointed at ours, and nothing else changed."""
    return IMPORT.sub(lambda m: f"{m.group(1)} monarch_kernel.monarch.actor", source)


@pytest.mark.parametrize("program", ["counter", "ping_pong", "generator_learner", "accumulator", "supervision"])
@pytest.mark.timeout(180)
def test_a_monarch_program_runs_with_only_its_import_changed(program, tmp_path):
    source = (PROGRAMS / f"{program}.py").read_text()
    ours = with_our_import(source)
    changed = [(a, b) for a, b in zip(source.splitlines(), ours.splitlines()) if a != b]
    assert changed and all(IMPORT.match(a) for a, _ in changed)  # only the import lines differ
    script = tmp_path / f"{program}.py"
    script.write_text(ours)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("OK")


def test_the_programs_cover_every_name_the_issue_lists():
    text = "\n".join(p.read_text() for p in PROGRAMS.glob("*.py"))
    for name in ["Actor", "endpoint", "this_host", "this_proc", "spawn_procs", ".spawn(", ".stop()",
                 "current_rank", "current_size", "ValueMesh", "Future", ".call(", ".call_one(", ".choose(",
                 ".broadcast(", ".stream(", "Accumulator", "Channel", "Port", "send(", ".slice(", ".flatten(",
                 ".rename(", ".split(", "__supervise__", "explicit_response_port", "await "]:
        assert name in text, name


# ------------------------------------------------------------------ shapes and value meshes


def test_split_flatten_and_rename_keep_the_ranks_in_row_major_order():
    shape = Shape.grid(hosts=4, gpus=2)
    split = shape.split(hosts=("dp", "pp"), pp=2)
    assert split.dims == (("dp", 2), ("pp", 2), ("gpus", 2)) and split.ranks == shape.ranks
    assert split.slice(pp=1, gpus=0).ranks == (2, 6)
    assert shape.flatten("rank").dims == (("rank", 8),)
    assert shape.rename(gpus="tp").names == ("hosts", "tp")
    with pytest.raises(MeshUsageError, match="do not divide"):
        shape.split(hosts=("dp", "pp"), pp=3)
    with pytest.raises(MeshUsageError, match="all but one"):
        shape.split(hosts=("dp", "pp"))
    with pytest.raises(MeshUsageError, match="twice"):
        shape.rename(gpus="hosts")
    with pytest.raises(MeshUsageError, match="no dim named"):
        shape.rename(nodes="hosts")


def test_a_value_mesh_slices_like_its_mesh():
    vm = ValueMesh(Shape.grid(hosts=2, gpus=3), list(range(6)))
    assert list(vm.slice(gpus=2).values()) == [2, 5]
    assert vm.slice(hosts=1).item(gpus=0) == 3
    assert vm.flatten("r").item(r=4) == 4
    assert vm.rename(gpus="tp").item(hosts=1, tp=2) == 5
    assert vm.get(5) == 5 and vm.size() == 6 and vm.size("gpus") == 3 and vm.sizes == {"hosts": 2, "gpus": 3}


# ------------------------------------------------------------------ on a live mesh


class Doubler(Actor):
    @endpoint
    def double(self, value):
        return 2 * value


class Answerer(Actor):
    def __init__(self):
        self.port: Port | None = None

    @endpoint(explicit_response_port=True)
    def later(self, port: Port) -> None:
        self.port = port

    @endpoint
    def now(self, value):
        assert self.port is not None
        self.port.send(value)
        return "sent"

    @endpoint
    def again(self):
        assert self.port is not None
        self.port.send("twice")

    @endpoint
    def holder(self):
        return self.port

    @endpoint
    def send_through(self, port: Port):
        port.send("from elsewhere")


class Raiser(Actor):
    @endpoint(explicit_response_port=True)
    def fails(self, port: Port) -> None:
        raise ValueError("before answering")


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")
    yield procs
    procs.stop()


@pytest.fixture
def spent_procs(monkeypatch):
    """Processes for a test that fails actors: as Monarch's, a process where an actor failed takes no new ones.
    The test hears unhandled failures (as Monarch's own tests do): the default hook would end this program."""
    import monarch_kernel.monarch.actor as facade

    monkeypatch.setattr(facade, "unhandled_fault_hook", lambda failure: None)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")
    yield procs
    procs.stop()


@pytest.mark.timeout(60)
def test_a_calls_port_answers_once_and_only_on_its_rank(procs):
    answerers = procs.spawn("answerers", Answerer)
    first = answerers.slice(gpus=0)
    pending = first.later.call_one()
    assert first.now.call_one(7).get() == "sent"
    assert pending.get(timeout=10) == 7
    with pytest.raises(Exception, match="already answered its call"):
        first.again.call_one().get()
    port = first.holder.call_one().get()  # the call's port, carried to another rank, cannot answer there
    with pytest.raises(Exception, match="answers a call made to rank 0"):
        answerers.slice(gpus=1).send_through.call_one(port).get()


@pytest.mark.timeout(60)
def test_an_endpoint_that_raises_before_answering_its_port_fails_the_call(spent_procs):
    raisers = spent_procs.spawn("raisers", Raiser)
    with pytest.raises(Exception, match="before answering"):
        raisers.slice(gpus=1).fails.call_one().get(timeout=10)


@pytest.mark.timeout(60)
def test_a_receive_times_out_and_a_closed_receiver_drops_later_messages(procs):
    answerers = procs.spawn("senders", Answerer)
    port, receiver = Channel.open()
    with pytest.raises(Exception, match="timed out"):
        receiver.recv().get(timeout=0.2)
    answerers.slice(gpus=1).send_through.call_one(port).get()
    assert receiver.recv().get(timeout=10) == "from elsewhere"
    del receiver
    answerers.slice(gpus=1).send_through.call_one(port).get()  # nobody listens: no error, nothing kept


@pytest.mark.timeout(60)
def test_a_pending_receive_keeps_its_port_open_after_the_receiver_is_dropped(procs):
    """A future from recv() outlived its receiver: the port closed and the message sent to it was lost (the
    future never finished); get_or_spawn_controller on a rank hands such a future back."""
    answerers = procs.spawn("keepers", Answerer)
    port, receiver = Channel.open()
    pending = receiver.recv()
    del receiver
    answerers.slice(gpus=1).send_through.call_one(port).get()
    assert pending.get(timeout=10) == "from elsewhere"


def test_endpoint_names_that_handles_use_are_refused(procs):
    class Clashing(Actor):
        @endpoint
        def stop(self):
            return None

    with pytest.raises(MeshUsageError, match="rename those endpoints"):
        procs.spawn("clashing", Clashing)


@pytest.mark.timeout(120)
def test_spawn_procs_meshes_appear_in_mesh_status_and_go_when_stopped():
    from IPython.testing.globalipapp import get_ipython

    from monarch_kernel.magics import current_registry

    ip = get_ipython()
    ip.run_line_magic("load_ext", "monarch_kernel")
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2}, name="from-monarch", dist="none")
        registry = current_registry()
        assert "from-monarch" in registry.names() and registry.current == "from-monarch"
        ip.run_line_magic("mesh", "status")
        procs.stop()
        assert wait_until(lambda: "from-monarch" not in registry.names(), 10)
    finally:
        ip.run_line_magic("unload_ext", "monarch_kernel")


class Gated(Actor):
    """Its constructor says it started, then waits until the test opens the `release` fifo."""

    def __init__(self, started: str, release: str) -> None:
        with open(started, "w") as mark:
            mark.write("started")
        with open(release) as gate:
            self.made = f"made after {gate.read()!r}"

    @endpoint
    async def value(self) -> str:
        return self.made


class Counted(Actor):
    def __init__(self, start: int) -> None:
        self.start = start

    @endpoint
    async def value(self) -> int:
        return self.start


class NeverMade(Actor):
    """Its constructor spawns a Counted on its own processes, sends it out, and never returns (Monarch's own test of
    spawning does the same)."""

    def __init__(self, procs, out: Port) -> None:
        out.send(procs.spawn("made_in_a_constructor", Counted, 42))
        threading.Event().wait()

    @endpoint
    async def unreachable(self) -> None:
        pass


@pytest.mark.timeout(90)
def test_spawn_returns_before_an_async_actors_constructor_ends_and_calls_wait_for_it(tmp_path):
    procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none")
    try:
        release = tmp_path / "release"
        os.mkfifo(release)
        gated = procs.spawn("gated", Gated, str(tmp_path / "started"), str(release))  # (its constructor waits on us)
        assert wait_until(lambda: (tmp_path / "started").exists(), 30)
        answer = gated.value.call_one()  # sent while the constructor still waits: the call waits in the mailbox
        with open(release, "w") as gate:
            gate.write("the release")
        assert answer.get(timeout=30) == "made after 'the release'"
    finally:
        procs.stop()


@pytest.mark.timeout(90)
def test_an_actor_whose_constructor_never_returns_holds_nothing_else_and_can_be_stopped():
    procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none")
    try:
        port, receiver = Channel.open()
        never = procs.spawn("never", NeverMade, procs, port)  # (returns: the constructor runs on the actor's own loop)
        counted = receiver.recv().get(timeout=30)  # what the constructor did before it blocked reaches us
        assert counted.value.call_one().get(timeout=30) == 42  # the processes serve other actors meanwhile
        never.stop().get(timeout=30)
        with pytest.raises(SupervisionError, match="stopped"):
            never.unreachable.call_one().get(timeout=30)
        with pytest.raises(SupervisionError, match="stopped"):  # what it spawned is its own: stopped with it
            counted.value.call_one().get(timeout=30)
    finally:
        procs.stop()


@pytest.mark.timeout(60)
def test_this_proc_on_a_rank_is_that_ranks_process(procs):
    class Spawner(Actor):
        @endpoint
        def pids(self) -> tuple[int, int]:
            from monarch_kernel.monarch.actor import this_proc

            child = this_proc().spawn("child", Child)
            return os.getpid(), child.pid.call_one().get()

    class Child(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    spawners = procs.spawn("spawners", Spawner)
    pairs = list(spawners.pids.call().get().values())
    assert all(mine == childs for mine, childs in pairs) and len({mine for mine, _ in pairs}) == 2


@pytest.mark.timeout(60)
def test_a_dead_rank_of_a_notebook_owned_mesh_reaches_the_hook_once_after_a_respawn(monkeypatch):
    import signal
    import threading

    import monarch_kernel.monarch.actor as facade

    class Dier(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    seen = []
    monkeypatch.setattr(facade, "unhandled_fault_hook", seen.append)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")
    try:
        procs.spawn("dier", Dier)
        dier = procs.spawn("dier", Dier)  # spawned again: the new one replaces the old on those ranks
        os.kill(dier.slice(gpus=1).pid.call_one().get(), signal.SIGKILL)
        assert wait_until(lambda: seen, 10)
        assert wait_until(lambda: not any(t.name == "mesh-supervision" for t in threading.enumerate()), 10)
        assert len(seen) == 1 and seen[0].rank == 1 and seen[0].kind == "died"
        assert "Dier dier{'gpus': 1/2}> and all its descendants have failed" in seen[0].report()
        assert "the process this actor was running on failed: Killed(sig=9)" in seen[0].report()  # Monarch's words
    finally:
        procs.stop()


def test_an_owner_is_told_once_per_dead_rank_about_its_newest_spawn_of_a_name():
    from monarch_kernel.controller.supervision import Supervisors
    from monarch_kernel.wire import messages as m
    from monarch_kernel.wire.calls import CallTable
    from monarch_kernel.wire.serialization import unseal

    sent = []
    supervisors = Supervisors(CallTable(), sent.append, lambda rank: rank == 0)
    for key in ("workers#0.1", "workers#0.2"):  # the owner on rank 0 spawned "workers" twice
        supervisors.own(m.OwnActors(0, "manager#-1.1", "actor mesh 'manager' on rank 0", key, "workers",
                                    "Worker", (1, 2)))
    supervisors.rank_died(2, "rank 2 died")
    supervisors.rank_died(2, "rank 2 died")  # (reported twice: told once)
    assert [(c.actor, c.endpoint, c.ranks) for c in sent] == [("manager#-1.1", "__supervise__", (0,))]
    (failure,), _ = unseal(sent[0].args)
    assert failure.mesh_name == "workers" and failure.rank == 2 and failure.kind == "died"


def test_an_owner_hears_of_a_death_that_the_controller_learnt_before_the_ownership():
    """A spawning actor's OwnActors and its new actors' death come on different paths (the owner's rank, the
    other mesh's host): under load the death came first and the owner never heard (Monarch's program 34
    timed out 1 run in 3 with busy loops beside it)."""
    from monarch_kernel.controller.supervision import Supervisors
    from monarch_kernel.wire import messages as m
    from monarch_kernel.wire.calls import CallTable
    from monarch_kernel.wire.serialization import unseal

    sent = []
    supervisors = Supervisors(CallTable(), sent.append, lambda rank: rank == 0)
    supervisors.rank_died(0, "rank 0 of mesh2 died", mesh="mesh2")  # before the owner's note came
    supervisors.own(m.OwnActors(0, "watcher#-1.1", "actor mesh 'watcher' on rank 0", "fragile#0.1", "fragile",
                                "Fragile", (0,), "mesh2"))
    assert [(c.actor, c.endpoint, c.ranks) for c in sent] == [("watcher#-1.1", "__supervise__", (0,))]
    (failure,), _ = unseal(sent[0].args)
    assert failure.mesh_name == "fragile" and failure.kind == "died" and "mesh2 died" in failure.report()
    supervisors.rank_died(0, "rank 0 of mesh2 died", mesh="mesh2")  # (told once)
    supervisors.mesh_restarted("mesh2")  # a later spawn on the restarted mesh hears of nothing past
    supervisors.own(m.OwnActors(0, "watcher#-1.1", "actor mesh 'watcher' on rank 0", "fragile#0.2", "fragile",
                                "Fragile", (0,), "mesh2"))
    assert len(sent) == 1


def test_an_actors_spawn_returns_once_the_controller_knows_the_owner(monkeypatch):
    """The spawn inside an actor waits for the controller's note (OwnActors.known): with the note held back
    a second on its way (as a loaded machine did), the endpoint that spawned still returns only after it."""
    import threading

    from monarch_kernel.controller.router import ControllerSender

    noted: list[str] = []
    note = ControllerSender.own_actors

    def slow_note(self, msg):
        def later():
            noted.append(msg.name)
            note(self, msg)

        threading.Timer(1.0, self._loop.call, (later,)).start()

    monkeypatch.setattr(ControllerSender, "own_actors", slow_note)

    class Spawner(Actor):
        @endpoint
        def spawn_child(self) -> list[str]:
            self.procs = this_host().spawn_procs(per_host={"gpus": 1})
            self.child = self.procs.spawn("child", Sleepy)
            return ["spawned"]

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        spawner = procs.spawn("spawner", Spawner)
        assert spawner.spawn_child.call_one().get(timeout=60) == ["spawned"]
        assert noted == ["child"]  # (before, the endpoint returned while the note was still on its way)
    finally:
        procs.stop()


def test_a_host_mesh_sent_elsewhere_carries_only_host_names_and_cannot_start_processes():
    import pickle

    copy = pickle.loads(pickle.dumps(this_host()))
    assert "controller" not in pickle.dumps(this_host()).decode("latin-1")  # no notebook-side class inside
    assert copy.extent == {} and "localhost" in repr(copy)
    with pytest.raises(MeshUsageError, match="only names its hosts"):
        copy.spawn_procs(per_host={"gpus": 1})


class Sleepy(Actor):
    def __init__(self):
        self.stopped = 0

    @endpoint
    async def nap(self, seconds: float) -> str:
        import asyncio

        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.stopped += 1
            raise
        return "rested"

    @endpoint
    async def times_stopped(self) -> int:
        return self.stopped


class Asker(Actor):
    def __init__(self, other):
        self.other = other.slice(gpus=0)

    @endpoint
    async def ask(self, seconds: float) -> str:
        return await self.other.nap.call_one(seconds)


def test_calls_between_proc_meshes_are_stopped_with_their_caller_and_fail_once_the_other_is_gone():
    """A call from an actor of one proc mesh to another's goes through the notebook's controller; stopping
    the caller's wait stops the endpoint on the other mesh, and a call to a stopped proc mesh is a
    SupervisionError (as in Monarch), not a hang."""
    from monarch_kernel import MeshTimeoutError, SupervisionError

    procs_a = this_host().spawn_procs(per_host={"gpus": 1})
    procs_b = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        sleepy = procs_b.spawn("sleepy", Sleepy)
        asker = procs_a.spawn("asker", Asker, sleepy)
        assert asker.ask.call_one(0.01).get(timeout=30) == "rested"
        with pytest.raises(MeshTimeoutError):
            asker.ask.call_one(60).get(timeout=1)  # the wait ends: the asker is cancelled, and so its call
        assert wait_until(lambda: sleepy.times_stopped.call_one().get(timeout=10) == 1, 10)
        procs_b.stop()
        with pytest.raises(Exception) as info:
            asker.ask.call_one(0.01).get(timeout=30)
        assert "SupervisionError" in str(info.value) or isinstance(info.value, SupervisionError), info.value
        assert "not running" in str(info.value)
    finally:
        procs_a.stop()
        procs_b.stop()


class Crasher(Actor):
    @endpoint
    async def pid(self) -> int:
        import os

        return os.getpid()

    @endpoint
    async def crash(self) -> None:
        import os

        os._exit(3)


class Caller(Actor):
    def __init__(self, other):
        self.other = other.slice(gpus=0)

    @endpoint
    async def twice(self) -> list:
        from monarch_kernel.wire.calls import find_sender

        first, second = await self.other.pid.call_one(), await self.other.pid.call_one()
        return [first == second, sorted((rank, bool(actor)) for _, rank, actor in find_sender("").direct._lanes)]

    @endpoint
    async def crash_it(self) -> str:
        try:
            await self.other.crash.call_one()
        except Exception as exc:  # noqa: BLE001 - its type is the answer
            return f"{type(exc).__name__}: {exc}"
        return "answered"


def test_after_a_first_call_an_actor_calls_another_local_proc_mesh_on_its_lanes_and_hears_of_its_death():
    """The controller tells the caller where the other mesh's ranks listen; later calls go there directly, and
    the callee's death still fails the call as a SupervisionError."""
    procs_a = this_host().spawn_procs(per_host={"gpus": 1})
    procs_b = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        crasher = procs_b.spawn("crasher", Crasher)
        caller = procs_a.spawn("caller", Caller, crasher)
        # (the second one on a lane to rank 0: the async crasher's own, read by its own loop)
        assert caller.twice.call_one().get(timeout=30) == [True, [(0, True)]]
        said = caller.crash_it.call_one().get(timeout=30)
        assert said.startswith("SupervisionError") and "went away" in said, said
    finally:
        procs_a.stop()
        procs_b.stop()


class Keeper(Actor):
    """Calls another proc mesh's async actor many times at once, before and after that actor is stopped."""

    def __init__(self, other):
        self.other = other.slice(gpus=0)

    @endpoint
    async def burst(self, count: int) -> list:
        import asyncio

        said = []
        for outcome in await asyncio.gather(*[self.other.nap.call_one(0) for _ in range(count)],
                                            return_exceptions=True):
            said.append(outcome if isinstance(outcome, str) else f"{type(outcome).__name__}: {outcome}")
        return said

    @endpoint
    async def rebind(self, other) -> None:
        self.other = other.slice(gpus=0)


def test_an_async_actor_called_on_its_own_lane_that_is_stopped_midway_answers_every_call_once_and_says_why():
    """Another proc mesh's actor calls an async actor on that actor's own lane; stopping the actor while calls
    are on their way answers each of them once, as served or as "stopped" (never as a rank that died), later
    calls say it was stopped, and its next spawn is called as before."""
    procs_a = this_host().spawn_procs(per_host={"gpus": 1})
    procs_b = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        sleepy = procs_b.spawn("sleepy", Sleepy)
        keeper = procs_a.spawn("keeper", Keeper, sleepy)
        assert keeper.burst.call_one(50).get(timeout=60) == ["rested"] * 50
        busy = keeper.burst.call_one(2000)
        sleepy.stop()
        said = busy.get(timeout=120)
        assert len(said) == 2000
        odd = [one for one in said if one != "rested" and "stopped" not in one]
        assert not odd, odd[:3]
        after = keeper.burst.call_one(3).get(timeout=60)
        assert all("stopped" in one for one in after), after
        again = procs_b.spawn("sleepy", Sleepy)
        keeper.rebind.call_one(again).get(timeout=30)
        assert keeper.burst.call_one(5).get(timeout=60) == ["rested"] * 5
    finally:
        procs_a.stop()
        procs_b.stop()


def test_monarch_config_acts_on_what_ours_has_and_refuses_unknown_names():
    from monarch_kernel.actors import procs
    from monarch_kernel.monarch import config

    before = procs.STOP_ACTORS_S
    with config.configured(stop_actor_timeout="1m 30s", enable_log_forwarding=True) as settings:
        assert procs.STOP_ACTORS_S == 90.0  # ProcMesh.stop() waits this long for the actors' clean-up
        assert settings["enable_log_forwarding"] is True and config.get_runtime_config()["stop_actor_timeout"] == "1m 30s"
    assert procs.STOP_ACTORS_S == before and config.get_runtime_config() == {}
    with pytest.raises(ValueError, match="invalid configuration key: `no_such_setting`"):
        config.configure(no_such_setting=1)
    with pytest.raises(ValueError, match="not a duration"):
        config.configure(stop_actor_timeout="soon")
    assert procs.STOP_ACTORS_S == before
    assert config.duration_seconds("500ms") == 0.5 and config.duration_seconds("1h 30m") == 5400.0


@pytest.mark.timeout(60)
def test_a_future_as_asyncio_resolves_on_the_running_loop_and_refuses_off_one(procs):
    import asyncio

    future = procs.spawn("asyncio_doublers", Doubler).slice(gpus=0).double.call_one(5)

    async def both() -> tuple:
        first, second = future.as_asyncio(), future.as_asyncio()  # each call: a fresh asyncio future
        assert isinstance(first, asyncio.Future) and first is not second
        return await first, await second

    assert asyncio.run(both()) == (10, 10)
    with pytest.raises(RuntimeError):
        future.as_asyncio()


class Printer(Actor):
    @endpoint
    def say(self, text: str) -> None:
        print(text, flush=True)

    @endpoint
    def log_error(self, text: str) -> None:
        logging.getLogger("printer").error(text)


def procs_and_their_mesh():
    """Two processes from this_host().spawn_procs, and the notebook's Mesh they are."""
    from monarch_kernel.actors import procs as procs_module

    started = []
    procs_module.mesh_started.append(started.append)
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")
    finally:
        procs_module.mesh_started.remove(started.append)
    return procs, started[0]


@pytest.mark.timeout(120)
def test_logging_option_hides_aggregates_and_sets_the_level_of_what_the_processes_print(capsys):
    """Monarch's `ProcMesh.logging_option`: what actors print is not shown, or shown in windows of similar lines
    (on its own stream), and `level` is the processes' log level; the window waiting is shown as they stop."""
    procs, mesh = procs_and_their_mesh()
    in_logs = lambda text: all(any(text in line for _, line in mesh.logs(rank)) for rank in (0, 1))  # noqa: E731
    try:
        printers = procs.spawn("printers", Printer)
        procs.logging_option(stream_to_client=False).get()
        printers.say.call("hidden line").get()
        assert wait_until(lambda: in_logs("hidden line"), 30)  # (it came, and was not shown)
        procs.logging_option(stream_to_client=True, aggregate_window_sec=3600, level=logging.CRITICAL).get()
        for step in range(3):
            printers.say.call(f"step {step} done").get()
        printers.log_error.call("below the level").get()
        assert wait_until(lambda: in_logs("step 2 done"), 30)
        procs.logging_option(stream_to_client=True, aggregate_window_sec=3600, level=logging.ERROR).get()
        printers.log_error.call("an error").get()
        assert wait_until(lambda: in_logs("an error"), 30)
        shown_before_stop = capsys.readouterr()
        assert "step 0 done" not in shown_before_stop.out  # (held in the window)
    finally:
        procs.stop()
    out, err = capsys.readouterr()
    assert "hidden line" not in out + shown_before_stop.out and "below the level" not in err + out
    # tagged as Monarch's processes tag their lines in groups: [local rank]
    assert re.search(r"^\[6 similar log lines\] \[\d\] step \d done$", out, re.M), out
    assert re.search(r"^\[2 similar log lines\] \[\d\] .*an error$", err, re.M), err
    assert "an error" not in out and "step" not in err
    with pytest.raises(ValueError, match="logging level"):
        procs.logging_option(level=300)


USER_MODULE = '''
import atexit

class Flushes:
    """A buffered file that only its finalizer writes out (as a user's global log file would)."""
    def __init__(self, path):
        self.out = open(path, "w")
        self.out.write("finalized")  # (buffered: lost unless the object is finalized)
    def __del__(self):
        self.out.close()

held = None

def start(folder, rank):
    global held
    held = Flushes(f"{folder}/finalized-{rank}")
    atexit.register(lambda: open(f"{folder}/atexit-{rank}", "w").write("ran"))
'''


class ImportsUserCode(Actor):
    @endpoint
    def start(self, folder: str) -> int:
        sys.path.insert(0, folder)
        import user_module_with_exit_work  # noqa: PLC0415 - the rank imports the user's module, as its code would

        from monarch_kernel.monarch.actor import current_rank
        user_module_with_exit_work.start(folder, current_rank().rank)
        return os.getpid()


@pytest.mark.timeout(120)
def test_stopping_a_proc_mesh_runs_its_users_exit_handlers_and_finalizers(tmp_path):
    """As an interpreter's exit does (Monarch's procs exit that way): a rank ends with os._exit, so without the
    exit work a global's buffered file and an atexit handler's work were lost."""
    (tmp_path / "user_module_with_exit_work.py").write_text(USER_MODULE)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")
    try:
        procs.spawn("importer", ImportsUserCode).start.call(str(tmp_path)).get()
        assert not (tmp_path / "atexit-0").exists()
        assert all((tmp_path / f"finalized-{rank}").read_text() == "" for rank in (0, 1))  # (still buffered)
    finally:
        procs.stop()
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.suffix != ".py" and p.name != "__pycache__"} == {
        "finalized-0": "finalized", "finalized-1": "finalized", "atexit-0": "ran", "atexit-1": "ran"}


@pytest.mark.timeout(120)
def test_a_stopped_proc_mesh_says_so_to_calls_and_spawns_and_its_name_can_start_anew():
    from monarch_kernel import SupervisionError

    procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none", name="stopped-then-new")
    printers = procs.spawn("printers", Printer)
    printers.say.call("hello").get()
    procs.stop()
    with pytest.raises(SupervisionError, match="actor mesh is stopped due to proc mesh shutdown"):
        printers.say.call("again").get()
    with pytest.raises(RuntimeError, match="`ProcMesh` has already been stopped"):
        procs.spawn("late", Printer)
    again = this_host().spawn_procs(per_host={"gpus": 1}, dist="none", name="stopped-then-new")
    try:
        again.spawn("printers", Printer).say.call("on the new one").get()
    finally:
        again.stop()


class _Fatal(BaseException):
    """What ends an actor in Monarch: an endpoint's BaseException that is no Exception (nor a stop)."""


class Fragile(Actor):
    @endpoint
    async def fail(self) -> None:
        raise _Fatal("simulated failure")

    @endpoint
    async def check(self) -> str:
        return "ok"

    @endpoint
    async def app_error(self) -> None:
        raise RuntimeError("an application error")

    @endpoint(explicit_response_port=True)
    async def through_port(self, port: Port) -> None:
        raise ValueError("raised instead of answering")


@pytest.mark.timeout(90)
def test_an_endpoint_raising_a_base_exception_fails_its_actor_and_the_notebook_hears_once(monkeypatch, spent_procs):
    """As in Monarch: the call raises SupervisionError in Monarch's words, later calls to that actor too (the other
    ranks serve on), the owner (here the notebook's hook) hears once; an application error leaves the actor as it
    was; an explicit-port endpoint that raises fails its actor. A process where an actor failed takes no new actors
    (Monarch's poisoned process); the others do."""
    import monarch_kernel.monarch.actor as facade
    from monarch_kernel.monarch.actor import ActorError, SupervisionError

    procs = spent_procs
    seen = []
    monkeypatch.setattr(facade, "unhandled_fault_hook", seen.append)
    fragile = procs.spawn("fragile", Fragile)
    with pytest.raises(ActorError, match="(?s)Actor call fragile.app_error failed.*an application error") as app:
        fragile.app_error.call().get(timeout=30)
    assert not isinstance(app.value, SupervisionError)
    assert list(fragile.check.call().get(timeout=30).values()) == ["ok", "ok"]
    with pytest.raises(SupervisionError, match=r"The actor .*Fragile fragile\{'gpus': 1/2\}> and all its "
                                               r"descendants have failed"):
        fragile.slice(gpus=1).fail.call_one().get(timeout=30)
    with pytest.raises(SupervisionError, match="_Fatal: simulated failure"):
        fragile.check.call().get(timeout=30)  # (rank 1's actor failed)
    assert fragile.slice(gpus=0).check.call_one().get(timeout=30) == "ok"
    assert wait_until(lambda: seen, 10)
    with pytest.raises(SupervisionError):
        fragile.slice(gpus=1).fail.call_one().get(timeout=30)  # (failed already: no second report)
    assert len(seen) == 1 and seen[0].rank == 1 and seen[0].kind == "exception"
    assert "Fragile fragile{'gpus': 1/2}> and all its descendants have failed" in seen[0].report()
    assert "_Fatal: simulated failure" in seen[0].report()

    for _ in range(2):  # (latched)
        late = procs.spawn("late", Fragile)  # (as Monarch's, the spawn returns: its initialized and calls raise)
        refusal = r"error spawning actor mesh 'late': 1 of its processes take no new actors after an actor there " \
                  r"failed \(rank 1: .*simulated failure"
        with pytest.raises(RuntimeError, match=refusal):
            late.initialized.get()
        with pytest.raises(RuntimeError, match=refusal):
            late.slice(gpus=0).check.call_one()
    assert fragile.slice(gpus=0).check.call_one().get(timeout=30) == "ok"  # (the spawn left nothing on rank 0)
    porting = procs.slice(gpus=0).spawn("porting", Fragile)
    with pytest.raises(SupervisionError, match="raised instead of answering"):
        porting.through_port.call_one().get(timeout=30)
    with pytest.raises(SupervisionError):
        porting.check.call_one().get(timeout=30)
    assert wait_until(lambda: len(seen) == 2, 10)


class Child(Actor):
    @endpoint
    async def fail(self) -> None:
        raise _Fatal("the child failed")


class Parent(Actor):
    def __init__(self, procs, handle: bool) -> None:
        self.children = procs.spawn("children", Child)
        self.heard: list = []
        self.handle = handle

    @endpoint
    async def fail_children(self, then_wait: float = 0.0) -> int:
        import asyncio

        from monarch_kernel.monarch.actor import SupervisionError

        try:
            await self.children.fail.call()
        except SupervisionError:
            await asyncio.sleep(then_wait)
            return len(self.heard)
        raise AssertionError("the children's failure did not raise")

    @endpoint
    async def check(self) -> str:
        return "ok"

    def __supervise__(self, failure) -> bool:
        self.heard.append(failure)
        return self.handle


@pytest.mark.timeout(120)
def test_an_owner_hears_of_its_failed_actors_before_their_call_returns_and_fails_when_it_does_not_handle_it(
        monkeypatch, spent_procs):
    """The owner's __supervise__ has run by the time the call that failed its actors raises in the owner (Monarch's
    order); an owner that does not handle the failure fails in turn: its running call raises at once (not after its
    wait), later calls too, and the failure goes on up to the notebook."""
    import monarch_kernel.monarch.actor as facade
    from monarch_kernel.monarch.actor import SupervisionError

    seen = []
    monkeypatch.setattr(facade, "unhandled_fault_hook", seen.append)
    procs = spent_procs
    children_procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")
    other_children = this_host().spawn_procs(per_host={"gpus": 2}, dist="none")  # (the first ones failed actors)
    try:
        handling = procs.slice(gpus=0).spawn("handling", Parent, children_procs, True)
        assert handling.fail_children.call_one().get(timeout=60) == 2  # both children heard of, before it returned
        assert handling.check.call_one().get(timeout=30) == "ok"

        careless = procs.slice(gpus=1).spawn("careless", Parent, other_children, False)
        with pytest.raises(SupervisionError, match=r"(?s)careless.*and all its descendants have failed.*children"):
            careless.fail_children.call_one(600.0).get(timeout=60)
        with pytest.raises(SupervisionError):
            careless.check.call_one().get(timeout=30)
        assert wait_until(lambda: any("not handled by" in f.report() for f in seen), 10)
    finally:
        children_procs.stop()
        other_children.stop()


class Aborting(Actor):
    @endpoint
    def abort(self, reason=None) -> None:
        from monarch_kernel.monarch.actor import context

        context().actor_instance.abort(reason)


@pytest.mark.timeout(60)
def test_abort_fails_its_actor_and_the_owner_hears_the_reason(monkeypatch, spent_procs):
    import monarch_kernel.monarch.actor as facade
    from monarch_kernel.monarch.actor import SupervisionError, context

    seen = []
    monkeypatch.setattr(facade, "unhandled_fault_hook", seen.append)
    for rank, name, reason, said in ((0, "aborting", "out of patience", "out of patience"),
                                     (1, "aborting_quietly", None, "no reason provided")):
        with pytest.raises(SupervisionError, match=said):
            spent_procs.slice(gpus=rank).spawn(name, Aborting).abort.call_one(reason).get(timeout=30)
    assert wait_until(lambda: len(seen) == 2, 10)
    assert "Aborting aborting> and all its descendants have failed" in seen[0].report()
    with pytest.raises(RuntimeError, match="root client"):
        context().actor_instance.abort("from the notebook")


def test_endpoints_carry_monarchs_flag_for_answers_sent_through_a_port():
    from monarch_kernel.monarch.actor import concurrent_endpoint

    class Flags(Actor):
        @endpoint
        def plain(self) -> None: ...

        @endpoint(explicit_response_port=True)
        def ported(self, port: Port) -> None: ...

        @concurrent_endpoint
        async def beside(self) -> None: ...

    class Child(Flags):
        @endpoint
        def own(self) -> None: ...

    assert not Flags.plain._explicit_response_port and not Child.own._explicit_response_port
    assert Flags.ported._explicit_response_port and Child.beside._explicit_response_port


UNHANDLED_FAILURE = '''
import atexit, time
from monarch_kernel.monarch.actor import Actor, SupervisionError, endpoint, this_host

class Exits(Actor):
    @endpoint
    def exit(self) -> None:
        raise SystemExit(3)  # a BaseException: the actor fails, and nobody supervises it

atexit.register(print, "atexit handlers ran", flush=True)
actor = this_host().spawn_procs({"gpus": 1}).spawn("exits", Exits)
try:
    actor.exit.call_one().get(timeout=30)
except SupervisionError:
    pass
'''


@pytest.mark.timeout(120)
def test_a_failure_nobody_handles_ends_a_program_as_in_monarch(tmp_path):
    """Monarch's default hook exits a program: its main thread is interrupted, so it ends the normal way
    (atexit handlers run) even where it would go on (here: sleeping for a minute)."""
    script = tmp_path / "unhandled.py"
    script.write_text(UNHANDLED_FAILURE + "time.sleep(60)\nprint('went on')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == -signal.SIGINT, done.stdout + done.stderr  # (an unhandled KeyboardInterrupt)
    assert "atexit handlers ran" in done.stdout and "went on" not in done.stdout
    assert "Unhandled monarch error on the root actor" in done.stderr
    assert "The actor <root>.<__main__.Exits exits{'gpus': 0/1}> and all its descendants have failed" in done.stderr
    assert "KeyboardInterrupt: the program ends: an actor mesh failure was not handled" in done.stderr \
        or "KeyboardInterrupt" in done.stderr.splitlines()[-1]


NOTEBOOK_HEARS = """
import threading
import monarch_kernel.monarch.actor as facade
heard = threading.Event()
shipped = facade.unhandled_fault_hook
def default_then_note(failure):
    shipped(failure)  # the default hook
    heard.set()
facade.unhandled_fault_hook = default_then_note
"""


@pytest.mark.timeout(180)
def test_a_failure_nobody_handles_is_shown_in_a_notebook_and_the_kernel_goes_on():
    from kernel_driver import kernel_with

    for kernel in kernel_with(NOTEBOOK_HEARS):
        run = kernel.execute(UNHANDLED_FAILURE + "assert heard.wait(60)\nprint('went on')\n", 90)
        assert run.status == "ok", run.text()
        assert "went on" in run.text()
        assert "unhandled actor mesh failure" in run.text(), run.text()
        assert "Exits exits" in run.text()
        assert kernel.execute("print(6 * 7)", 30).text().strip().endswith("42")


@pytest.mark.timeout(120)
def test_lines_printed_by_processes_of_the_monarch_api_are_tagged_as_monarchs(capsys):
    """`[host pid] [local rank] line`, as Monarch's processes print them (a notebook's own mesh: `[rank N]`)."""
    procs, mesh = procs_and_their_mesh()
    pids = {s.rank: s.pid for s in mesh.status()}
    seen: list[str] = []
    try:
        procs.spawn("printers", Printer).slice(gpus=1).say.call_one("one line").get()
        assert wait_until(lambda: seen.append(capsys.readouterr().out) or "one line" in "".join(seen), 30)
    finally:
        procs.stop()
    assert f"[localhost {pids[1]}] [1] one line\n" in "".join(seen)


ANOTHER_CLIENT = '''
import sys
import cloudpickle
from monarch_kernel.monarch.actor import Actor, endpoint, this_host

class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        import os
        return os.getpid()

theirs = cloudpickle.loads(sys.stdin.buffer.read())
own = this_host().spawn_procs({"gpus": 1}, name=theirs.mesh_name)  # a mesh of the same name, its own
try:
    theirs.spawn("pids", Pid)
except Exception as exc:
    print(f"refused: {type(exc).__name__}: {exc}", flush=True)
print("own pid", own.spawn("pids", Pid).pid.call_one().get(timeout=30), flush=True)
own.stop()
'''


@pytest.mark.timeout(120)
def test_a_proc_mesh_of_another_client_process_is_refused_not_mistaken_for_one_of_its_own(tmp_path):
    """Monarch's client may hand its ProcMesh to another client process. Here a mesh is known by name to the
    client that started it: another client that spawned on the handle reached its own mesh of that name."""
    procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none", name="handed_over")
    try:
        script = tmp_path / "other_client.py"
        script.write_text(ANOTHER_CLIENT)
        done = subprocess.run([sys.executable, str(script)], input=cloudpickle.dumps(procs), capture_output=True,
                              timeout=100)
        out = done.stdout.decode()
        assert done.returncode == 0, out + done.stderr.decode()
        assert "refused: MeshUsageError: this ProcMesh (mesh 'handed_over') was started by another client process" \
            in out, out
        assert f"pid {os.getpid()}" in out
        assert "own pid" in out
        assert cloudpickle.loads(cloudpickle.dumps(procs)).spawn("again", Raiser) is not None  # its own client: fine
    finally:
        procs.stop()
