"""The notebook's session: what the kernel process sets up for its meshes, owned in one place.

It holds the notebook's own state: the names it gives unnamed cells and meshes, `this_proc()`'s
process, and each mesh's synced folders and measured figures (`of_mesh`). The layers below keep
small holders that any process may read: the default output sink, the reporter of actor calls'
timings, the rewriter of remote tracebacks (core/failures), who adopts the meshes a Monarch
program starts (actors/procs), the meshes still open and the controller's loop (controller/),
the call senders and ports (wire/calls, which ranks use too). In the notebook only the
`Session` writes the hooks: `install` when the extension loads, `uninstall` when it unloads,
and `close` when the kernel exits (the one `atexit` of controller/runtime.py calls the same
steps). Each step may run twice: the second time does nothing.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from monarch_kernel.actors import procs
from monarch_kernel.api import sinks
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.core.failures import set_traceback_rewriter
from monarch_kernel.core.source import CellNames
from monarch_kernel.core.timing import TimingReporter

T = TypeVar("T")


@dataclass(frozen=True)
class NotebookHooks:
    """How this notebook shows what meshes do: set together, removed together."""

    sink_factory: sinks.SinkFactory | None = None  # the default sink of a run (live output in a cell)
    timing_reporter: TimingReporter | None = None  # per-rank timing of actor calls
    traceback_rewriter: Callable[[str], str] | None = None  # remote tracebacks named like IPython's cells
    adopt_mesh: Callable[[Any], None] | None = None  # meshes started by spawn_procs join the %mesh registry


class Session:
    """The kernel process's one session (`Session.current()`)."""

    _current: ClassVar[Session | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.hooks: NotebookHooks | None = None
        self.cell_names = CellNames()  # `cell N` for code run without a name (the same N for the same code)
        self.mesh_numbers = itertools.count(0)  # `meshN` for meshes started without a name
        self.this_proc: Any = None  # (ProcMesh, Mesh) of this_proc(), started on first use
        self.this_proc_lock = threading.Lock()
        self._per_mesh: dict[type, weakref.WeakKeyDictionary[MeshRuntime, Any]] = {}

    @classmethod
    def current(cls) -> Session:
        """This process's session (made on first use)."""
        with cls._lock:
            if cls._current is None:
                cls._current = Session()
            return cls._current

    @property
    def installed(self) -> bool:
        """Whether a notebook's hooks are in place."""
        return self.hooks is not None

    def install(self, hooks: NotebookHooks) -> None:
        """Put a notebook's hooks in place (those of an earlier install are removed first)."""
        self.uninstall()
        sinks.set_default_sink_factory(hooks.sink_factory)
        sinks.set_timing_reporter(hooks.timing_reporter)
        set_traceback_rewriter(hooks.traceback_rewriter)
        if hooks.adopt_mesh is not None:
            procs.mesh_started.append(hooks.adopt_mesh)
        self.hooks = hooks

    def uninstall(self) -> None:
        """Remove the hooks: plain output again (nothing happens if none are in place)."""
        hooks, self.hooks = self.hooks, None
        if hooks is None:
            return
        sinks.set_default_sink_factory(None)
        sinks.set_timing_reporter(None)
        set_traceback_rewriter(None)
        if hooks.adopt_mesh in procs.mesh_started:
            procs.mesh_started.remove(hooks.adopt_mesh)

    def of_mesh(self, runtime: MeshRuntime, kind: type[T], make: Callable[[], T]) -> T:
        """This session's state of kind `kind` for a mesh (its synced folders, its measured figures...):
        made by make() on first use, gone with the mesh."""
        table = self._per_mesh.setdefault(kind, weakref.WeakKeyDictionary())
        found = table.get(runtime)
        if found is None:
            found = table[runtime] = make()
        return found

    def open_meshes(self) -> list[MeshRuntime]:
        """The meshes of this process not shut down yet (by API, magic or spawn_procs)."""
        return [runtime for runtime in list(MeshRuntime._open) if not runtime.closed]

    def close(self) -> None:
        """The end of the kernel: hooks removed, every open mesh shut down, the controller's loop ended."""
        self.uninstall()
        for runtime in self.open_meshes():
            try:
                runtime.leave()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        ControllerLoop.stop()
