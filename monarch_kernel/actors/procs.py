"""ProcMesh and HostMesh: processes and hosts named by Monarch-style dims.

>>> procs = this_host().spawn_procs(per_host={"gpus": 4})   # notebook: a new local mesh
>>> counters = procs.spawn("counters", Counter, 0)         # one Counter per process
>>> procs.slice(gpus=0).spawn("one", Counter, 0)

A ProcMesh is a handle: its mesh's name and a Shape over the mesh's ranks. It works in
the notebook and on ranks (pass it to an actor, which may spawn on it: that actor then
owns, and supervises, what it spawned). Spawning goes to each rank's system actor, the
same way from anywhere. Only the notebook starts and stops processes: a HostMesh made
there (`this_host()`, `mesh.host_mesh()`) carries how to start a mesh on its hosts, and
`spawn_procs` returns the new mesh's ProcMesh, shaped by the host dims then `per_host`'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from monarch_kernel.actors.base import Actor, check_endpoint_kinds, current_actor
from monarch_kernel.actors.client import STOPPED_PROC_MESHES, ActorMesh, system_actors
from monarch_kernel.actors.owned import record
from monarch_kernel.actors.ports import Channel, Port, PortReceiver
from monarch_kernel.actors.rank_loop import run_on_rank_loop
from monarch_kernel.actors.spawning import spawn_actor_mesh
from monarch_kernel.core.bootstrap_command import BootstrapCommand
from monarch_kernel.core.errors import ActorError, MeshUsageError, RemoteError
from monarch_kernel.core.future import DoneFuture, FailedFuture, Future
from monarch_kernel.core.proc_bind import check_bindings
from monarch_kernel.core.shape import MeshShaped, Point, Shape
from monarch_kernel.wire.calls import find_sender
from monarch_kernel.wire.messages import GetController, ProcsRequest, StartProcs, StopProcs
from monarch_kernel.wire.ops import StopAllActors
from monarch_kernel.wire.serialization import seal

STOP_ACTORS_S = 30.0  # how long ProcMesh.stop() gives the actors' clean-up before the processes end
START_TIMEOUT_S = 600.0  # how long an actor waits for the notebook to start processes for it
_NO_BOOTSTRAP = ("spawn_procs(bootstrap=...) runs in the notebook; in an actor, do the set-up in the constructor of "
                 "the actors you spawn on the new processes")

A = TypeVar("A", bound=Actor)
# starts a mesh of `count` ranks per host on these hosts (notebook only): (hosts, count, name, options)
StartMesh = Callable[[tuple[Any, ...], int, "str | None", dict[str, Any]], Any]
# called with each mesh that spawn_procs starts (the notebook's %mesh registry adopts it)
mesh_started: list[Callable[[Any], None]] = []
# called with each ProcMesh that spawn_procs returns (Monarch's register_proc_mesh_spawn_callback)
proc_mesh_spawned: list[Callable[[ProcMesh], None]] = []


_PROCESS_TOKEN = secrets.token_hex(8)


def _this_client() -> str:
    """Who this client process is ("" on a rank): a mesh's name means something only to the client (and its
    ranks) that started it. The pid is read each time: a forked child is another client."""
    sender = find_sender("")
    if sender is not None and sender.own_rank is not None:
        return ""
    return f"{socket.gethostname()} pid {os.getpid()} ({_PROCESS_TOKEN})"


class ProcMesh(MeshShaped):
    """Processes of a mesh, shaped by named dims: spawn actor meshes on them."""

    def __init__(self, mesh_name: str, shape: Shape, *, stop: Callable[[], None] | None = None,
                 host_mesh: Callable[[], Any] | None = None, logging_option: Callable[..., None] | None = None,
                 failed: BaseException | None = None, client: str = ""):
        self._client = client  # the client process that started these processes, where known ("": this one's)
        self._mesh = mesh_name
        self._failed = failed  # why these processes never came up (spawn_procs' bootstrap raised)
        self.shape = shape  # dims over the mesh's global ranks
        self._stop = stop  # the notebook's way to end these processes (not carried to ranks)
        self._host_mesh = host_mesh
        self._logging_option = logging_option  # the notebook's mesh's (`Mesh.logging_option`; not carried either)

    @property
    def mesh_name(self) -> str:
        """The name of the mesh these processes are (or are part of)."""
        return self._mesh

    # ------------------------------------------------------------ shape
    def _with(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._mesh, shape, stop=None, host_mesh=self._host_mesh, logging_option=self._logging_option,
                        failed=self._failed, client=self._client)

    # ------------------------------------------------------------ actors
    def spawn(self, name: str, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorMesh:
        """One `actor_class(*args, **kwargs)` per process, as actor mesh `name`; returns its handle.

        Returns once every process has the actor's mailbox, as Monarch's: an async actor's constructor runs
        after that, on the actor's own event loop, and calls sent meanwhile wait for it (a sync actor's runs
        before the spawn returns). As in Monarch, a constructor
        that raises does not fail the spawn: that rank's failure goes to the owner's `__supervise__` (or
        the notebook's `unhandled_fault_hook`, which prints it by default), and calls to that actor raise
        SupervisionError with the constructor's traceback. Spawned inside an actor, the actor owns it.
        """
        if self._failed is not None:
            raise self._failed
        if self._mesh in STOPPED_PROC_MESHES:
            raise RuntimeError(f"`ProcMesh` has already been stopped (mesh {self._mesh!r}): spawn on new processes "
                               "(HostMesh.spawn_procs)")
        if isinstance(actor_class, type) and issubclass(actor_class, Actor):
            check_endpoint_kinds(actor_class)
        system = system_actors(self._mesh, self.shape)
        return spawn_actor_mesh(self._mesh, self.shape, name, actor_class, args, kwargs,
                                lambda op, label: system.operate.call(op).get(), supervise_constructor=True)

    # ------------------------------------------------------------ processes
    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """End these processes (and their actors); only the notebook that made them can."""
        if self._stop is None:
            raise MeshUsageError("stop() ends processes that this notebook started (spawn_procs); a slice or a "
                                 "handle passed to an actor cannot stop them: stop the actor meshes instead")
        self._stop()
        STOPPED_PROC_MESHES.add(self._mesh)
        return DoneFuture(None)

    def logging_option(self, stream_to_client: bool = False, aggregate_window_sec: float | None = None,
                       level: int = logging.INFO) -> Future[None]:
        """How what these processes print outside calls' answers (their endpoints' prints and log records) shows
        in the notebook, as in Monarch: not at all (`stream_to_client=False`), each line as it comes, or every
        `aggregate_window_sec` seconds as groups of similar lines ("[64 similar log lines] ..."); `level` is
        their root logger's level. Done when it returns (awaitable, as Monarch's)."""
        if self._logging_option is None:
            raise MeshUsageError("logging_option() is for processes this notebook started (spawn_procs in the "
                                 "notebook); in an actor, the notebook shows what its processes print")
        self._logging_option(stream_to_client, aggregate_window_sec, level)
        return DoneFuture(None)

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stop is not None:  # (as Monarch's: the processes end with the block)
            self.stop()

    @property
    def initialized(self) -> Future[bool]:
        """Done: spawn_procs returns once the processes are up (raises ActorError if its `bootstrap` raised)."""
        return DoneFuture(True) if self._failed is None else FailedFuture(self._failed)

    @property
    def host_mesh(self) -> Any:
        """The hosts these processes run on (in the notebook)."""
        if self._host_mesh is None:
            raise MeshUsageError("host_mesh is known in the notebook that started these processes")
        return self._host_mesh()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_carried_proc_mesh, (self._mesh, self.shape, self._client or _this_client()))

    def __repr__(self) -> str:
        return f"<ProcMesh of mesh {self._mesh!r} {self.shape}>"


def _carried_proc_mesh(mesh_name: str, shape: Shape, client: str) -> ProcMesh:
    """A ProcMesh that was pickled: on a rank, or in the client that started it, it is that mesh's; in
    another client process (which knows its own meshes by name, not that one's) spawning on it fails and
    says why, rather than reaching a mesh of that name of its own."""
    here = _this_client()
    if not here or not client or client == here:
        return ProcMesh(mesh_name, shape, client=client if not here else "")
    return ProcMesh(mesh_name, shape, client=client, failed=MeshUsageError(
        f"this ProcMesh (mesh {mesh_name!r}) was started by another client process ({client}): only that client "
        "and its actors can spawn on it. Spawn from an actor of that client, or start processes of this one's "
        "with this_host().spawn_procs()"))


class HostMesh(MeshShaped):
    """Hosts, shaped by named dims (`hosts`, or none for one host): `spawn_procs` starts processes."""

    def __init__(self, hosts: Sequence[Any], shape: Shape, start: StartMesh | None = None, *, for_actor: bool = False,
                 owned: bool = True, check: Callable[[], None] | None = None,
                 release: Callable[[], None] | None = None):
        self._hosts = tuple(hosts)
        self.shape = shape  # dims over host indices
        self._start = start  # starts a mesh on some of these hosts
        self._for_actor = for_actor  # a rank's own host: the notebook starts processes for its actor
        self._owned = owned  # False for a slice or a copy (pickled): a reference, which cannot stop the hosts
        self._check = check  # what `initialized` asks of the hosts (attach_to_workers: that each worker is there)
        self._release = release  # what shutdown() does last (attach_to_workers: end the workers)
        self._spawned: list[Any] = []  # the meshes spawn_procs started
        # the hosts while they can be used; None once shut down (Monarch's name: its programs look at it)
        self._inner_host_mesh: tuple[Any, ...] | None = self._hosts

    def _with(self, shape: Shape) -> HostMesh:
        picked = [self._hosts[i] for i in shape.ranks]
        return HostMesh(picked, Shape(shape.dims, tuple(range(len(picked)))), self._start, owned=False,
                        check=self._check)

    def spawn_procs(self, per_host: dict[str, int] | None = None,
                    bootstrap: Callable[[], None] | Callable[[], Awaitable[None]] | None = None,
                    name: str | None = None, proc_bind: list[dict[str, str]] | None = None,
                    bootstrap_command: BootstrapCommand | Callable[[Point], BootstrapCommand] | None = None,
                    **mesh_options: Any) -> ProcMesh:
        """Start `per_host` processes on each host (e.g. {"gpus": 4}); returns their ProcMesh.

        `bootstrap` runs once in each new process before it is handed out (an `async def` one on the
        process's actor event loop, as an async endpoint would run; if it raises, the processes are stopped
        and `initialized` and `spawn` raise ActorError). `proc_bind`, as Monarch's: one dict per process of a
        host pinning it to CPUs or NUMA nodes (`{"cpus": "0-3"}`; keys cpus, cpunodebind, physcpubind,
        membind). `bootstrap_command`, as Monarch's: a BootstrapCommand (`default_bootstrap_cmd().with_env(...)`)
        or a callable giving each process's from its Point (see core/bootstrap_command.py for what applies to
        forked processes). `mesh_options` go to the mesh (`dist`, `env`, `preload`, `timeout`, ...): by default a
        local mesh is started as `%mesh up local` starts one, and processes on another mesh's hosts copy that
        mesh's settings.
        """
        if self._inner_host_mesh is None:
            raise RuntimeError("HostMesh has already been shut down: spawn on a new one (this_host(), or a new job's)")
        if self._start is None and not self._for_actor:
            raise MeshUsageError("spawn_procs() starts processes on the hosts of a HostMesh made in the notebook or "
                                 "by this_host(); a HostMesh passed to an actor only names its hosts")
        per_host = dict(per_host or {})
        for size in per_host.values():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshUsageError(f"per_host={per_host!r}: each dim needs a positive size, e.g. {{'gpus': 4}}")
        if set(per_host) & set(self.shape.names):
            raise MeshUsageError(f"per_host dims {sorted(per_host)} repeat the host mesh's {self.shape.names}")
        count = math.prod(per_host.values()) if per_host else 1
        if proc_bind is not None:
            check_bindings(proc_bind, count)  # (ValueError, Monarch's words, before anything starts)
            mesh_options["proc_bind"] = [dict(bind) for bind in proc_bind]
        hosts = self
        if bootstrap_command is not None:
            hosts = self._with_commands(bootstrap_command, per_host, mesh_options)
        if self._for_actor:
            if bootstrap is not None:
                raise MeshUsageError(_NO_BOOTSTRAP)
            mesh: Any = _start_from_rank(self._hosts, count, name, mesh_options, per_host)
        else:
            assert self._start is not None
            mesh = self._start(hosts._hosts, count, name, mesh_options)
        failed = _bootstrapped(mesh, bootstrap) if bootstrap is not None else None
        self._spawned.append(mesh)
        STOPPED_PROC_MESHES.discard(mesh.name)  # (a new mesh of a stopped one's name)
        for started in mesh_started:
            started(mesh)
        dims = (*self.shape.dims, *per_host.items())
        procs = ProcMesh(mesh.name, Shape(dims, mesh.ranks), stop=lambda: stop_actors_then_processes(mesh),
                         host_mesh=lambda: self, logging_option=getattr(mesh, "logging_option", None), failed=failed)
        if self._for_actor:
            record(current_actor.get(), f"processes of mesh {mesh.name!r}", procs.stop)  # (stopped with their starter)
        for spawned in list(proc_mesh_spawned):
            spawned(procs)
        return procs

    def _with_commands(self, command: BootstrapCommand | Callable[[Point], BootstrapCommand],
                       per_host: dict[str, int], options: dict[str, Any]) -> HostMesh:
        """The hosts to start on, and each process's variables in `options`, for spawn_procs(bootstrap_command=)."""
        points = list(Shape((*self.shape.dims, *per_host.items()),
                            tuple(range(len(self._hosts) * math.prod(per_host.values())))).points())
        commands = [command if isinstance(command, BootstrapCommand) else command(point) for point in points]
        if not all(isinstance(c, BootstrapCommand) for c in commands):
            raise MeshUsageError("bootstrap_command: give a BootstrapCommand (default_bootstrap_cmd().with_env(...)) "
                                 "or a callable that returns one for each process's Point")
        if any(c.arg0 is not None or c.args for c in commands):
            raise MeshUsageError("bootstrap_command: processes here are forked from their host's agent, so only a "
                                 "command's program and env apply; leave arg0 and args out")
        programs = {c.program for c in commands}
        if len(programs) > 1:
            raise MeshUsageError(f"bootstrap_command: one program per spawn_procs (the interpreter the hosts' agents "
                                 f"run), not {sorted(programs)}; vary env per process instead")
        options["rank_env"] = [dict(c.env) for c in commands]
        program = programs.pop()
        if program == sys.executable or self._for_actor:  # (an actor's processes run its own mesh's interpreter)
            if program != sys.executable:
                raise MeshUsageError("bootstrap_command in an actor: the new processes run this mesh's interpreter "
                                     f"({sys.executable}); set only env")
            return self
        return self.with_python_executable(program)

    def with_python_executable(self, python_executable: str) -> HostMesh:
        """The same hosts, whose new processes run `python_executable` (an interpreter, or a script that execs
        one); processes that those processes' actors start on their own host run it too."""
        if self._start is None:
            raise MeshUsageError("with_python_executable() is for a HostMesh made in the notebook or by this_host(); "
                                 "in an actor, the processes it starts already run its own mesh's interpreter")
        hosts = [dataclasses.replace(h, python=python_executable)
                 if dataclasses.is_dataclass(h) and not isinstance(h, type) else h for h in self._hosts]
        return HostMesh(hosts, self.shape, self._start, owned=self._owned, check=self._check, release=self._release)

    @property
    def initialized(self) -> Future[bool]:
        """Whether the hosts can take spawns: done at once, or for workers (attach_to_workers) once each answered;
        raises why not (Monarch's connects in the background)."""
        if self._check is not None:
            try:
                self._check()
            except Exception as exc:  # noqa: BLE001 - the future raises it
                return FailedFuture(exc)
        return DoneFuture(True)

    def attached(self) -> HostMesh:
        """A new HostMesh on the same hosts, owning what it spawns (a job's next client: its own stop and
        shutdown end only its own processes)."""
        return HostMesh(self._hosts, self.shape, self._start, for_actor=self._for_actor, check=self._check,
                        release=self._release)

    @property
    def is_fake_in_process(self) -> bool:
        """Always False: spawn_procs starts real OS processes (Monarch's fake in-process hosts are for its tests)."""
        return False

    def shutdown(self) -> Future[None]:
        """Stop every process that spawn_procs started on these hosts (their actors' clean-up first); the
        HostMesh takes no more spawns. As in Monarch, a second shutdown raises RuntimeError, and so does the
        shutdown of a reference (a slice, or a HostMesh that was pickled): shut down the one it came from."""
        self._stop_processes("shut down")
        self._inner_host_mesh = None
        if self._release is not None:
            self._release()
        return DoneFuture(None)

    def stop(self) -> Future[None]:
        """Stop every process that spawn_procs started through this HostMesh (their actors' clean-up first), and
        only those: the hosts stay, for this HostMesh and others on them (a job's next `state()`), as Monarch's."""
        self._stop_processes("stop")
        return DoneFuture(None)

    def _stop_processes(self, what: str) -> None:
        if not self._owned:
            raise RuntimeError(f"cannot {what} `HostMesh` that is a reference instead of owned (a slice, or one that "
                               f"was pickled): {what} the HostMesh it came from")
        if self._inner_host_mesh is None:
            raise RuntimeError("HostMesh has already been shut down")
        spawned, self._spawned = self._spawned, []
        for mesh in spawned:
            stop_actors_then_processes(mesh)

    def __enter__(self) -> HostMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._inner_host_mesh is not None:
            self.shutdown()

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    def __reduce__(self) -> tuple[Any, ...]:
        # elsewhere it can be looked at, not spawned on; its hosts travel as names (a rank must not load the
        # notebook's host specs)
        return (_host_reference, ([getattr(h, "name", str(h)) for h in self._hosts], self.shape))

    def __repr__(self) -> str:
        names = ", ".join(getattr(h, "name", str(h)) for h in self._hosts)
        return f"<HostMesh {self.shape} of {names}>"


def _host_reference(hosts: list[str], shape: Shape) -> HostMesh:
    """A HostMesh unpickled: it names its hosts (a reference: it cannot spawn on them or stop them)."""
    return HostMesh(hosts, shape, owned=False)


def stop_actors_then_processes(mesh: Any) -> None:
    """ProcMesh.stop(): every actor is stopped first (its concurrent tasks cancelled, its `__cleanup__`
    run, as Monarch does), for at most STOP_ACTORS_S, then the processes end (once: a later stop does nothing)."""
    if getattr(mesh, "closed", False):
        return
    try:
        ask = getattr(mesh, "_ask", None)  # (the notebook's Mesh; one started for an actor just ends)
        if ask is not None:
            ask(StopAllActors(), "stop the actors", timeout=STOP_ACTORS_S)
    except Exception as exc:  # noqa: BLE001 - a dead rank or a slow clean-up must not keep the processes
        print(f"ProcMesh.stop(): stopping the actors of mesh {mesh.name!r} first failed ({exc}); "
              "its processes end now", file=sys.stderr)
    finally:
        mesh.shutdown()


class _StartedForActor:
    """A mesh the notebook started for an actor (what HostMesh.spawn_procs needs of it, on a rank)."""

    def __init__(self, name: str, shape: Shape):
        self.name = name
        self.ranks = shape.ranks
        self.closed = False

    def call(self, fn: Callable[[], None]) -> None:
        raise MeshUsageError(_NO_BOOTSTRAP)

    def shutdown(self) -> None:
        self.closed = True  # (once: its owner's stop and a stop of its own may both come)
        _ask_notebook(StopProcs(self.name), "stopping processes")


def _ask_notebook(op: StartProcs | StopProcs | GetController, what: str) -> Any:
    """Have the notebook start or stop processes for this rank's actor (or give it a controller); waits for its
    answer (serving)."""
    return _asked_notebook(op, what).get()


def _asked_notebook(op: StartProcs | StopProcs | GetController, what: str) -> Future[Any]:
    """Ask the notebook as `_ask_notebook` does; the future of its answer (get() waits START_TIMEOUT_S at most;
    an async endpoint awaits it without holding the rank's event loop)."""
    sender = find_sender("")
    if sender is None or sender.own_rank is None:
        raise MeshUsageError(f"{what} for an actor happens on a rank")
    port: Port[Any]
    receiver: PortReceiver[Any]
    port, receiver = Channel.open(once=True)
    sender.send_up(ProcsRequest(sender.own_rank, (port._owner, port._port_id), op))
    return receiver.recv(timeout=START_TIMEOUT_S)


def _start_from_rank(hosts: tuple[Any, ...], count: int, name: str | None, options: dict[str, Any],
                     per_host: dict[str, int]) -> _StartedForActor:
    mesh_name, shape = _ask_notebook(StartProcs(tuple(per_host.items()), name or "", seal(options)),
                                     "starting processes")
    return _StartedForActor(mesh_name, shape)


def controller_from_rank(name: str, actor_class: type, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Future[ActorMesh]:
    """get_or_spawn_controller in an endpoint: the notebook keeps the one actor of that name (spawning it now
    if there is none) and hands it back. Awaitable: the controller may be spawned on this very process, whose
    event loop an async endpoint must not hold while it waits."""
    return _asked_notebook(GetController(name, seal((actor_class, args, kwargs))), "getting a controller")


def this_host_of_rank() -> HostMesh:
    """On a rank: its own host, where an actor may start processes (the notebook starts them for it)."""
    return HostMesh(["this host"], Shape((), (0,)), for_actor=True)


def this_proc_of_rank() -> ProcMesh:
    """On a rank: the one process running this code, as a ProcMesh with no dims."""
    sender = find_sender("")
    if sender is None or sender.own_rank is None:
        raise MeshUsageError("this_proc_of_rank() runs on ranks")
    return ProcMesh("", Shape((), (sender.own_rank,)))


def _bootstrapped(mesh: Any, bootstrap: Callable[[], Any]) -> ActorError | None:
    """Run spawn_procs' `bootstrap` on every new process; if it raised (or a process died), the processes are
    stopped and the error is kept for `initialized` and `spawn` to raise, as Monarch's lazy ProcMesh does."""
    try:
        mesh.call(_run_bootstrap, bootstrap)
    except RemoteError as exc:  # (not an interrupt: MeshInterrupted is a KeyboardInterrupt)
        mesh.shutdown()
        error = ActorError(f"spawn_procs(bootstrap={getattr(bootstrap, '__qualname__', bootstrap)!s}) failed on "
                           f"ranks {exc.ranks} of mesh {mesh.name!r}; its processes were stopped", exc.failures)
        print(f"{error.summary}: `initialized` and spawn on them raise why", file=sys.stderr)
        return error
    except BaseException:
        mesh.shutdown()
        raise
    return None


def _run_bootstrap(bootstrap: Callable[[], Any]) -> None:
    """On a new process: run `bootstrap`, and a coroutine it returns on the process's actor loop."""
    result = bootstrap()
    if inspect.iscoroutine(result):
        run_on_rank_loop(result)
