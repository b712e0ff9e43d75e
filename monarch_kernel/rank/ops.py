"""A rank's handlers of the internal operations (`wire/ops.py`), one per operation type.

The notebook sends them as `RunOp` requests (they run as user code: a stop interrupts them,
their prints show in the cell); another rank's actors send `SpawnActors`/`StopActors` to
this rank's system actor. Both go through `RankOps.handle`.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from monarch_kernel.actors.base import endpoint, endpoint_parameters
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.versions import versions
from monarch_kernel.rank import profiling
from monarch_kernel.rank.debugging import RankDebugger
from monarch_kernel.rank.exit_work import run_exit_work
from monarch_kernel.rank.user_process_groups import remake_default_group
from monarch_kernel.wire import ops
from monarch_kernel.wire.ops import ACTOR_OPERATIONS
from monarch_kernel.wire.serialization import unseal

if TYPE_CHECKING:
    from monarch_kernel.core.identity import ActorIdentity
    from monarch_kernel.core.shape import Shape
    from monarch_kernel.rank.autoreload import Reloader
    from monarch_kernel.rank.cell import CellRunner


class Actors(Protocol):
    """The rank's actors, as the operations use them (rank/actor_host.ActorHost)."""

    def spawn(self, name: str, key: str, cls: type, args: tuple, kwargs: dict, shape: Shape,
              sources: dict[str, list[str]], creator: ActorIdentity | None = None,
              supervise_constructor: bool = False,
              outcome_port: tuple[int, int, str] | None = None) -> str | ops.ConstructorFailed | ops.SpawnRefused:
        """Create this rank's instance of an actor mesh (see ActorHost.spawn)."""

    def stop_key(self, key: str) -> bool:
        """Stop this rank's actor of a spawn; whether it was there."""

    def fail_key(self, key: str, report: str) -> bool:
        """Fail this rank's actor of a spawn (an owned failure it did not handle); whether it was there."""

    def stop_all(self) -> int:
        """Stop every actor mesh here (the processes are about to end); how many there were."""

    def meshes(self) -> list[tuple[str, str, Any, Shape]]:
        """The actor meshes here: (name, spawn key, this rank's instance, shape)."""


class RankOps:
    """The table of this rank's operation handlers (keyed by the operation's type)."""

    def __init__(self, rank: int, namespace: dict[str, Any], runner: CellRunner, reloader: Reloader,
                 debugger: RankDebugger) -> None:
        self._rank = rank
        self._namespace = namespace
        self._runner = runner
        self._reloader = reloader
        self._actors: Actors | None = None
        self._table: dict[type, Callable[[Any], Any]] = {
            ops.SpawnActors: self._spawn,
            ops.StopActors: lambda op: self.actors.stop_key(op.key),
            ops.FailActor: lambda op: self.actors.fail_key(op.key, op.report),
            ops.StopAllActors: self._stop_all_actors,
            ops.Describe: self._describe,
            ops.PostMortem: lambda op: debugger.post_mortem() if op.in_debugger else post_mortem(),
            ops.HasFailedCell: lambda op: getattr(sys, "last_traceback", None) is not None,
            ops.UseWorkspace: self._use_workspace,
            ops.SetAutoreload: self._set_autoreload,
            ops.Versions: lambda op: versions(),
            ops.ApplyLayout: self._apply_layout,
            ops.MeasureRank: lambda op: _measure_rank(),
            ops.TrialLayout: _trial_layout,
            ops.CollectGarbage: lambda op: gc.collect(),
            ops.SetLogLevel: lambda op: logging.getLogger().setLevel(op.level),
            ops.RemakeDefaultGroup: lambda op: remake_default_group(op.key),
            ops.StartProfile: lambda op: profiling.start(),
            ops.StopProfile: lambda op: profiling.stop(),
            ops.ReadClock: lambda op: profiling.clock_us(),
            ops.ListActorMeshes: lambda op: self._actor_meshes(),
            ops.StartDebugger: lambda op: debugger.start(op.session),
            ops.StopDebugger: lambda op: debugger.stop(),
        }
        assert set(self._table) == set(ops.RANK_OPERATIONS), "every rank operation has a handler"

    @property
    def actors(self) -> Actors:
        """The rank's actors (set once the ActorHost exists: it takes this table for its system actor)."""
        assert self._actors is not None
        return self._actors

    def serve_actors(self, actors: Actors) -> None:
        """Handle actor operations on `actors`."""
        self._actors = actors

    def handle(self, op: Any) -> Any:
        """Run one operation here; its answer."""
        handler = self._table.get(type(op))
        if handler is None:
            raise TypeError(f"rank {self._rank} has no operation {type(op).__name__} (another monarch_kernel version?)")
        return handler(op)

    # ------------------------------------------------------------ handlers
    def _spawn(self, op: ops.SpawnActors) -> str | ops.ConstructorFailed | ops.SpawnRefused:
        cls, args, kwargs = unseal(op.actor)
        return self.actors.spawn(op.name, op.key, cls, args, kwargs, op.shape, op.sources, op.creator,
                                 op.supervise_constructor, op.outcome_port)

    def _stop_all_actors(self, op: ops.StopAllActors) -> int:
        stopped = self.actors.stop_all()
        run_exit_work(self._namespace)  # (the processes end next: the user's exit handlers and finalizers run now)
        return stopped

    def _actor_meshes(self) -> dict[str, ops.ActorMeshEntry]:
        return {name: ops.ActorMeshEntry(key, type(instance).__name__, type(instance)._endpoints,
                                         endpoint_parameters(type(instance)), shape)
                for name, key, instance, shape in self.actors.meshes()}

    def _describe(self, op: ops.Describe) -> Any:
        from monarch_kernel.rank.tensorinfo import describe

        return describe(self._runner.evaluate(op.expr), self._rank)

    def _use_workspace(self, op: ops.UseWorkspace) -> str:
        if op.folder is not None:
            folder = op.folder
        else:
            from monarch_kernel.core.workspace import private_host_path

            folder = private_host_path(op.key, create=False)
        return use_workspace(folder, op.chdir, self._reloader)

    def _set_autoreload(self, op: ops.SetAutoreload) -> bool:
        self._reloader.enable(op.on)
        return op.on

    def _apply_layout(self, op: ops.ApplyLayout) -> str:
        from monarch_kernel.planner.apply import build_in_layout
        from monarch_kernel.planner.layout import Layout

        spec, batch = unseal(op.plan)
        layout = Layout.parse(op.layout)
        model, optimizer, step, device_mesh = build_in_layout(spec, layout, batch)
        model_name, optimizer_name, step_name = op.names
        self._namespace.update({model_name: model, optimizer_name: optimizer, step_name: step,
                                "device_mesh": device_mesh})
        return layout.text


def _measure_rank() -> Any:
    from monarch_kernel.planner.measure import rank_figures

    return rank_figures()


def _trial_layout(op: ops.TrialLayout) -> Any:
    from monarch_kernel.planner.layout import Layout
    from monarch_kernel.planner.measure import trial_layout

    spec, batch = unseal(op.plan)
    return trial_layout(spec, Layout.parse(op.layout), batch, op.steps)


def use_workspace(folder: str, chdir: bool, reloader: Reloader) -> str:
    """Put a synced folder first on sys.path (and make it the working directory); returns it."""
    folder = os.path.realpath(folder)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    importlib.invalidate_caches()
    reloader.watch(folder)
    if chdir:
        os.chdir(folder)
    return folder


def post_mortem() -> bool:
    """pdb at the error of this rank's last failed cell (False if it had none); for %mesh debug."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return False
    import pdb

    debugger = pdb.Pdb(nosigint=True)
    debugger.reset()
    debugger.interaction(None, tb)
    return True


class SystemActor:
    """The system actor of every rank (key SYSTEM_ACTOR): actors of other ranks (and ProcMesh
    handles anywhere) spawn and stop actors here, with the same operations the notebook sends."""

    def __init__(self, ops: RankOps):
        self._ops = ops

    @endpoint
    def operate(self, op: Any) -> Any:
        """Run one actor operation (SpawnActors, StopActors) on this rank."""
        if type(op) not in ACTOR_OPERATIONS:
            raise MeshUsageError(f"the system actor takes {', '.join(c.__name__ for c in ACTOR_OPERATIONS)}, "
                                 f"not {type(op).__name__}")
        return self._ops.handle(op)
