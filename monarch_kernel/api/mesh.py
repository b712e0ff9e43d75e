"""Mesh: the user's handle on a set of ranks (a whole mesh or a slice of one).

>>> mesh = local_mesh(gpus=4, dist="gloo")
>>> mesh.run("import torch.distributed as dist; dist.get_rank()")
>>> mesh.slice(gpus=slice(0, 2)).push(lr=1e-3)
>>> mesh.pull("lr")
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from monarch_kernel.actors.client import ActorMesh
from monarch_kernel.actors.procs import HostMesh
from monarch_kernel.actors.spawning import spawn_actor_mesh
from monarch_kernel.api import environment, hangs, profiles, sampling, workspace
from monarch_kernel.api.futures import MeshFuture, raise_failures
from monarch_kernel.api.kept_state import KeptState
from monarch_kernel.api.mesh_files import HostFiles
from monarch_kernel.api.mesh_start import start_runtime
from monarch_kernel.api.session import Session
from monarch_kernel.api.sinks import IdleOutput, OutputSink, default_sink
from monarch_kernel.api.values import check_device, seal_named
from monarch_kernel.controller.hosts import HostKind, HostSpec
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.controller.state import MeshSpec, RankSnapshot, Request
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.shape import Selector, Shape
from monarch_kernel.core.source import check_syntax
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.messages import HealthTimings
from monarch_kernel.wire.ops import Describe, HasFailedCell, PostMortem, RankOperation, SetLogLevel
from monarch_kernel.wire.serialization import arriving_on, release, seal, unseal

T = TypeVar("T")
REGROUP_GRACE_S = 3.0  # how long an interrupt waits for the stopped runs to end, to make the group anew


class Mesh(HostFiles, KeptState):
    """Ranks you can run code on, push values to and pull values from."""

    def __init__(self, runtime: MeshRuntime, shape: Shape):
        self._runtime = runtime
        self._shape = shape
        runtime.sender.regrouper = functools.partial(hangs.regroup_after_stopped_calls, runtime)
        runtime.sender.call_watcher = functools.partial(hangs.watch_call, runtime)

    # ------------------------------------------------------------ description
    @property
    def name(self) -> str:
        """The mesh's name (as used by `%mesh use NAME`)."""
        return self._runtime.name

    @property
    def shape(self) -> Shape:
        """Named dims and their sizes, e.g. {hosts: 1, gpus: 4}; `.sizes` gives a dict."""
        return self._shape

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks in this mesh or slice, row-major."""
        return self._shape.ranks

    @property
    def backend(self) -> str:
        """The torch.distributed backend the ranks were started with."""
        return self._runtime.spec.backend

    @property
    def closed(self) -> bool:
        """Whether the mesh was shut down."""
        return self._runtime.closed

    @property
    def kind(self) -> str:
        """Where its ranks run: "local" (this machine), "ssh", "slurm" or "ray"."""
        kinds = {h.kind for h in self._runtime.spec.hosts}
        return next((k for k in (HostKind.SLURM, HostKind.RAY, HostKind.SSH, HostKind.WORKER) if k in kinds),
                    HostKind.LOCAL)

    @property
    def hosts(self) -> list[str]:
        """The names of its hosts, in host order."""
        return [h.name for h in self._runtime.spec.hosts]

    @property
    def allocation(self) -> str | None:
        """The scheduler's job the mesh runs in, state and time left (None: no scheduler)."""
        return self.allocation_line()

    def allocation_line(self, max_age_s: float = 0.0) -> str | None:
        """Like `allocation`, reusing an answer at most max_age_s old (for views that redraw often)."""
        found = self._runtime.spec.allocation
        return found.status_line(max_age_s) if found is not None else None

    @property
    def health(self) -> HealthTimings:
        """How soon silence counts as failure (ping, host-lost, heartbeat, unresponsive timings)."""
        return self._runtime.spec.health

    def status(self) -> list[RankSnapshot]:
        """Each rank's state: idle, busy, dead or unresponsive, with host and pid."""
        chosen = set(self.ranks)
        return [s for s in self._runtime.snapshot() if s.rank in chosen]

    def logs(self, rank: int, lines: int = 50) -> list[tuple[str, str]]:
        """The last (stream, line) pairs a rank printed, including between cells."""
        if rank not in self._runtime.ranks:
            raise MeshUsageError(f"mesh {self.name!r} has no rank {rank}")
        return self._runtime.state.ranks[rank].log.tail(lines)

    def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = None,
                       level: int | None = None) -> None:
        """How text the ranks print outside cells (actor endpoints, their threads) shows in the notebook
        (Monarch's `ProcMesh.logging_option`): `stream_to_client=False` shows none (`mesh.logs(rank)` still has
        it); `aggregate_window_sec=N` shows it every N seconds as groups of similar lines, each once with how
        many there were (None: each line as it comes, the default); `level` sets the ranks' root logger level."""
        if level is not None and (not isinstance(level, int) or not 0 <= level <= 255):
            raise ValueError(f"Invalid logging level: {level}")
        if aggregate_window_sec is not None and (not stream_to_client or aggregate_window_sec <= 0):
            raise MeshUsageError(f"aggregate_window_sec={aggregate_window_sec!r}: give a positive window, with "
                                 "stream_to_client=True (output not shown cannot be aggregated)")
        idle = self._runtime.idle_output
        if isinstance(idle, IdleOutput):
            idle.set_mode(stream_to_client, aggregate_window_sec)
        if level is not None:
            self._ask(SetLogLevel(level), "set the log level")

    def tag_lines_as_monarch(self) -> None:
        """Tag what the ranks print outside cells as Monarch's processes do, `[host pid] [local rank] line`, and
        `[local rank] line` in groups of similar lines (meshes started through the Monarch API; a notebook's
        mesh keeps `[rank N] line`)."""
        idle, ranks = self._runtime.idle_output, self._runtime.state.ranks

        def monarchs(rank: int) -> str:  # (on the controller's loop, which keeps the ranks' states)
            state = ranks.get(rank)
            return f"[rank {rank}]" if state is None else f"[{state.host} {state.pid}] [{state.local_rank}]"

        def in_groups(rank: int) -> str:
            state = ranks.get(rank)
            return f"[{rank if state is None else state.local_rank}]"

        if isinstance(idle, IdleOutput):
            idle.tag_lines_with(monarchs, in_groups)

    def agent_log(self, host: int | str, lines: int = 50) -> str:
        """The last lines of a host agent's log (its stderr): start-up problems, crashes."""
        return self._runtime.state.agent_log(host, lines)

    # ------------------------------------------------------------ slicing
    def slice(self, **selectors: Selector | None) -> Mesh:
        """A sub-mesh: `mesh.slice(hosts=0, gpus=slice(0, 2))`; ints drop the dim."""
        return Mesh(self._runtime, self._shape.slice(**selectors))

    def select_ranks(self, ranks: list[int]) -> Mesh:
        """A 1-D sub-mesh over the given global ranks."""
        return Mesh(self._runtime, self._shape.select_ranks(ranks))

    # ------------------------------------------------------------ work
    def run(self, code: str, *, timeout: float | None = None, fail_fast: bool = False,
            sink: OutputSink | None = None, dedupe: bool = True, name: str | None = None) -> ValueMesh:
        """Run code on every rank; returns each rank's last-expression value.

        Output streams live to `sink` (default: the notebook's live view). Raises
        SyntaxError before sending, RemoteError if any rank fails.
        """
        return self.run_async(code, timeout=timeout, fail_fast=fail_fast, sink=sink,
                              dedupe=dedupe, name=name).get()

    def run_async(self, code: str, *, timeout: float | None = None, fail_fast: bool = False,
                  sink: OutputSink | None = None, dedupe: bool = True, name: str | None = None,
                  background: bool = False, filename: str | None = None) -> MeshFuture:
        """Start code on every rank and return at once with a MeshFuture.

        With background=True, live output is delivered from a helper thread (to the
        cell that started the run) even if nobody calls get(). `filename`: the name the
        ranks compile the code under (default `<mesh NAME>`; a debugger's file for the cell).
        """
        filename = filename or f"<mesh {name or Session.current().cell_names.name_of(code)}>"
        check_syntax(code, filename)
        if workspace.workspaces_of(self._runtime).auto:  # edits made since the last cell go first
            workspace.sync_changed(self._runtime)
        label = name or (filename.strip("<>") if filename.startswith("<") else "cell")
        future = self._submit(lambda rid: m.RunCell(rid, code, filename), label=label, timeout=timeout,
                              fail_fast=fail_fast, sink=sink, dedupe=dedupe, finish=self._values,
                              background=background)
        if background:
            future.pump_in_background()
        return future

    def run_script(self, path: str, argv: Sequence[str] = (), *, timeout: float | None = None,
                   fail_fast: bool = False, sink: OutputSink | None = None) -> None:
        """Run a script on every rank as torchrun would: `__main__`, `sys.argv`, its folder on `sys.path`.

        On a local mesh the script runs from this process's working folder (where torchrun
        would have been started); on SSH and Slurm hosts the file must exist there. The
        mesh's process group serves the script's own init_process_group; output, errors,
        interrupts and timeouts work as for cells.
        """
        cwd = None
        if self.kind == HostKind.LOCAL:  # as torchrun started from here: this folder, this path
            path, cwd = os.path.abspath(path), os.getcwd()
        code = (f"__import__('monarch_kernel.rank.script', fromlist=['run_script'])"
                f".run_script({path!r}, {[str(a) for a in argv]!r}, {cwd!r})")
        self.run(code, timeout=timeout, fail_fast=fail_fast, sink=sink, name=f"script {os.path.basename(path)}")

    def push(self, **values: Any) -> None:
        """Assign variables in each rank's namespace: `mesh.push(lr=0.1, model=net)`."""
        self.push_async(**values).get()

    def push_async(self, **values: Any) -> MeshFuture:
        """Start a push; returns a MeshFuture."""
        if not values:
            raise MeshUsageError("push() needs at least one name=value")
        sealed = seal_named(values, self._runtime.state.shm_dir_for(self.ranks))
        names = ", ".join(values)
        return self._submit(lambda rid: m.Push(rid, sealed), label=f"push({names})",
                            on_done=lambda: release(sealed), finish=lambda req: raise_failures(req, self._runtime))

    def pull(self, expr: str, *, timeout: float | None = None, device: str | None = None) -> ValueMesh:
        """Evaluate an expression on every rank and bring the values back.

        Tensors arrive in host memory, as they do in the values of `run` and `call` (from a rank
        on this machine, a view of the shared memory the rank copied them to once, even from its
        GPU); `device="cuda:0"` puts them there.
        """
        check_syntax(expr, "<mesh pull>")
        if device is not None:
            check_device(device)
        return self._submit(lambda rid: m.Pull(rid, expr), label=f"pull({expr!r})", timeout=timeout,
                            finish=lambda req: self._values(req, device)).get()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> ValueMesh:
        """Call ``fn(*args, **kwargs)`` on every rank (it travels by cloudpickle)."""
        sealed = seal(functools.partial(fn, *args, **kwargs), shm_dir=self._runtime.state.shm_dir_for(self.ranks),
                      shared=True)
        return self._submit(lambda rid: m.Call(rid, sealed), label=f"call({getattr(fn, '__name__', 'fn')})",
                            timeout=timeout, on_done=lambda: release(sealed), finish=self._values).get()

    def _ask(self, op: RankOperation, label: str, timeout: float | None = None) -> ValueMesh:
        """Run an internal operation (`wire/ops.py`) on every rank of this mesh; the ranks' answers."""
        return self._submit(lambda rid: m.RunOp(rid, op), label=label, timeout=timeout, finish=self._values).get()

    def _submit(self, make_body: Callable[[int], Any], *, label: str, finish: Callable[[Request], Any],
                timeout: float | None = None, fail_fast: bool = False, sink: OutputSink | None = None,
                dedupe: bool = True, on_done: Callable[[], None] | None = None,
                background: bool = False) -> MeshFuture[Any]:
        if sink is None:
            sink = default_sink(ranks=self.ranks, dedupe=dedupe, label=label, background=background)
        req = self._runtime.requests.submit(self.ranks, make_body, label=label, fail_fast=fail_fast, on_done=on_done)
        return MeshFuture(self._runtime, req, sink, finish, timeout=timeout)

    def _values(self, req: Request, device: str | None = None) -> ValueMesh[Any]:
        values = []
        failed = bool(req.failures)
        with arriving_on(device or "cpu"):  # (the notebook's GPU, if it has one, is the ranks')
            for rank in self.ranks:
                result = req.results.get(rank)
                failed = failed or result is None or result.failure is not None
                values.append(None if result is None or result.value is None else unseal(result.value))
        vm = ValueMesh(self._shape, values)
        if failed:
            raise_failures(req, self._runtime, partial=vm)
        return vm

    def history(self, last: int | None = None) -> Any:
        """How long each rank took for each cell, push, pull and call (oldest first).

        A pandas DataFrame when pandas is installed, else a list of dicts with keys
        label, rank, host, seconds, ok, finished_at. `last` keeps the newest N records.
        """
        chosen = set(self.ranks)
        records = [r._asdict() for r in list(self._runtime.state.history) if r.rank in chosen]
        if last is not None:
            records = records[-last:]
        try:
            import pandas
        except ImportError:
            return records
        return pandas.DataFrame.from_records(records, columns=["label", "rank", "host", "seconds", "ok", "finished_at"])

    def plan(self, build: Callable[[], Any], batch: Callable[[], Any], **options: Any) -> Any:
        """Which layouts of `build()` fit this mesh and which is fastest (`monarch_kernel.api.planning.plan`)."""
        from monarch_kernel.api.planning import plan

        return plan(build, batch, mesh=self, **options)

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """One `actor_class(*args, **kwargs)` per rank, as actor mesh `name`.

        Returns an ActorMesh: `trainers.step.call(x).get()` and friends. Each rank's
        instance is also `actors[name]` in `%%mesh` cells. Spawning a name again replaces
        those actors on these ranks (as re-running a notebook cell expects).
        """
        return spawn_actor_mesh(self.name, self._shape, name, actor_class, args, kwargs,
                                lambda op, label: self._ask(op, label), notebook_hook=False)

    def host_mesh(self) -> HostMesh:
        """This mesh's hosts as a Monarch-style HostMesh (dim `hosts`): `spawn_procs` starts new
        processes there with this mesh's settings (backend, environment, Slurm job)."""
        hosts = self._runtime.spec.hosts
        return HostMesh(hosts, Shape.grid(hosts=len(hosts)), functools.partial(start_like, self._runtime.spec))

    def describe(self, expr: str) -> ValueMesh[Any]:
        """What `expr` is on each rank (tensor, DTensor or module), as metadata: shapes, placements, bytes.

        No tensor data crosses the wire; `visualize_sharding` draws these.
        """
        check_syntax(expr, "<mesh describe>")
        return self._ask(Describe(expr), f"describe({expr!r})")

    def debug(self) -> bool:
        """Post-mortem pdb (like `%debug`) on the ranks of this mesh whose last cell failed.

        The debugger's prompts come to the notebook (one box for the ranks that ask alike).
        False if no rank had a failed cell.
        """
        return any(self._ask(PostMortem(), "debug").values())

    def failed_ranks(self) -> list[int]:
        """The ranks of this mesh whose last cell failed (their errors are kept for post-mortem)."""
        return sorted(rank for rank, failed in self._ask(HasFailedCell(), "failed cells").by_rank().items() if failed)

    def debug_in_debugger(self) -> bool:
        """Open the error of the last failed cell of this mesh's one rank in the visual debugger running
        there (JupyterLab's panels; `%mesh debug post-mortem`). Returns when the debugger continues;
        False if that rank had no failed cell."""
        if len(self.ranks) != 1:
            raise MeshUsageError("post-mortem in the debugger is for one rank: select it first")
        return any(self._ask(PostMortem(in_debugger=True), f"post-mortem on rank {self.ranks[0]}").values())

    # ------------------------------------------------------------ control
    def interrupt(self) -> None:
        """Send KeyboardInterrupt to whatever the ranks of this mesh are running.

        Where the stop ended collectives (a signal cannot reach into one), every rank makes the
        default group anew before this returns, so the next cell's collectives work.
        """
        stopped = self._runtime.requests.in_flight(self.ranks)
        self._runtime.requests.interrupt(self.ranks)
        for line in hangs.regroup_after_interrupt(self._runtime, stopped, REGROUP_GRACE_S):
            print(f"monarch_kernel: {line}", file=sys.stderr, flush=True)

    def restart(self) -> None:
        """Replace all ranks of the whole mesh with fresh ones (namespaces are reset).

        Synced workspaces are synced again and put back on the fresh ranks' sys.path.
        """
        self._runtime.restart()
        workspace.reapply(self._runtime, self._ask_on)

    # ------------------------------------------------------------ why a cell hangs
    @property
    def hang_after_s(self) -> float | None:
        """A running cell whose ranks make no progress this long shows why (None: never); `%mesh config hang`."""
        return self._runtime.inspections.hang_after_s

    @hang_after_s.setter
    def hang_after_s(self, seconds: float | None) -> None:
        if seconds is not None and (not isinstance(seconds, int | float) or seconds <= 0):
            raise MeshUsageError(f"hang_after_s={seconds!r}: give a number of seconds > 0, or None for never")
        self._runtime.inspections.hang_after_s = None if seconds is None else float(seconds)

    def why(self) -> hangs.Diagnosis:
        """Why the ranks of this mesh (or slice) are where they are: which rank waits in which collective
        for whom, or where each runs its own code; `str()` is the verdict, a notebook shows the stacks too."""
        return hangs.why(self._runtime, self.ranks)

    def stacks(self, all_threads: bool = False, timeout: float = 1.5) -> hangs.Diagnosis:
        """Every rank's Python stack now, grouped across ranks (it works while a rank waits in a C call;
        ranks that do not answer within `timeout` are named)."""
        return hangs.why(self._runtime, self.ranks, all_threads=all_threads, timeout=timeout)

    def profiled(self, run: Callable[[], T], folder: str = "mesh-profiles", label: str = "cell") -> T:
        """run() (a cell, say) with torch.profiler on every rank of this mesh; one merged Chrome/Perfetto
        trace (a process per rank, clocks lined up) is written to `folder`, and the top operations shown."""
        return profiles.profiled(lambda op: self._ask(op, type(op).__name__).by_rank(), run, folder, label,
                                 lambda text: print(text, flush=True))

    def sample_stacks(self, seconds: float = 5.0) -> sampling.FlameTable:
        """Where the time goes on the ranks of this mesh: their Python stacks sampled for `seconds`,
        as a flame table per group of ranks that spend it alike (the ranks are not stopped)."""
        if not seconds > 0:
            raise MeshUsageError(f"seconds={seconds!r}: sample for a positive number of seconds")
        return sampling.sample(self._runtime, self.ranks, seconds)

    def native_stacks(self) -> hangs.NativeStackText:
        """py-spy's dump of each rank, native frames included (for a rank stuck in a C call holding the GIL)."""
        return hangs.native_stacks(self._runtime, self.ranks)

    def _ask_on(self, ranks: list[int], op: RankOperation, label: str) -> ValueMesh:
        whole = Mesh(self._runtime, Shape.grid(hosts=len(self._runtime.spec.hosts), gpus=self._runtime.spec.gpus))
        return whole.select_ranks(ranks)._ask(op, label)

    @classmethod
    def started(cls, runtime: MeshRuntime) -> Mesh:
        """The handle on a runtime that just started (a host that may run other versions is checked now)."""
        mesh = cls(runtime, Shape.grid(hosts=len(runtime.spec.hosts), gpus=runtime.spec.gpus))
        if any(h.kind != HostKind.LOCAL for h in runtime.spec.hosts):  # another machine may run other versions
            environment.warn_if_mismatched(runtime, mesh._ask_on)
        return mesh

    def shutdown(self) -> None:
        """Stop the whole mesh: every rank and agent process ends (a persistent one too, and its record)."""
        self._runtime.shutdown()

    def leave(self) -> None:
        """Let go of the mesh as the kernel's end does: shut down, or left for the next kernel if persistent."""
        self._runtime.leave()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        states: dict[str, list[int]] = {}
        for s in self.status():
            states.setdefault(s.state, []).append(s.rank)
        text = ", ".join(f"{k} {format_ranks(v)}" for k, v in sorted(states.items()))
        return f"<Mesh {self.name!r} {self._shape} dist={self.backend}: {text}>"


def start_like(spec: MeshSpec, hosts: tuple[HostSpec, ...], gpus: int, name: str | None,
               options: dict[str, Any]) -> Mesh:
    """A new mesh on some of the hosts of the mesh `spec`, with its settings unless `options` say otherwise."""
    allocation = spec.allocation
    if allocation is not None and dataclasses.is_dataclass(allocation) and hasattr(allocation, "owned"):
        allocation = dataclasses.replace(allocation, owned=False)  # its own mesh ends the job
    known = {"dist", "env", "preload", "timeout", "master_addr", "health", "proc_bind", "rank_env"}
    if set(options) - known:
        raise MeshUsageError(f"spawn_procs() on a mesh's hosts takes {', '.join(sorted(known))}; "
                             f"not {', '.join(sorted(set(options) - known))}")
    return Mesh.started(start_runtime(list(hosts), gpus, options.get("dist", spec.backend), name, options.get("env", spec.env),
                       options.get("timeout", spec.start_timeout_s), options.get("master_addr", spec.master_addr),
                       options.get("health", spec.health), allocation=allocation,
                       preload=options.get("preload", spec.preload), relay_branching=spec.relay_branching,
                       proc_bind=options.get("proc_bind"), rank_env=options.get("rank_env")))


