"""Loading and unloading the IPython extension."""

from __future__ import annotations

import threading
from typing import Any

from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.session import NotebookHooks, Session
from monarch_kernel.views.base import TextHtmlView
from monarch_kernel.views.display import rank_labels, show, show_mesh, show_plan, widget_for
from monarch_kernel.views.errortext import ipython_cell_names
from monarch_kernel.views.live import KernelPublisher, LiveOutput, TerminalOutput, WidgetPublisher
from monarch_kernel.views.timing import run_timing_view

from . import debugger, sidebar
from .mesh_magic import MeshMagics
from .registry import MeshRegistry

PLAN_TYPE = ("monarch_kernel.api.planning", "Plan")  # shown by name: loading the extension imports no torch

_state: dict[str, Any] = {}


def _sink_factory(shell):
    def make(options: dict[str, Any]):
        ranks, dedupe = tuple(options.get("ranks", ())), options.get("dedupe", True)
        if getattr(shell, "kernel", None) is not None:
            if options.get("background"):
                announcement = (f"[{options.get('label', 'run')} is running in the background; its output "
                               "appears here. Get its value with `await fut` or `fut.get()`]")
                return LiveOutput(ranks, dedupe=dedupe, publisher=WidgetPublisher(), announcement=announcement)
            return LiveOutput(ranks, dedupe=dedupe, publisher=KernelPublisher(shell))
        return TerminalOutput(ranks, dedupe=dedupe)

    return make


def load_ipython_extension(ipython) -> None:
    """Register %mesh/%%mesh and route mesh output into the running cell."""
    if "registry" in _state:
        return
    registry = MeshRegistry()
    magics = MeshMagics(ipython, registry)
    ipython.register_magics(magics)
    if getattr(ipython, "kernel", None) is not None:  # a mesh as a cell's value: the live view
        ipython.display_formatter.ipython_display_formatter.for_type(Mesh, _display_mesh)
    ipython.display_formatter.ipython_display_formatter.for_type(TextHtmlView, show)  # widgets, or rich
    ipython.display_formatter.ipython_display_formatter.for_type_by_name(*PLAN_TYPE, show_plan)  # (no torch until a plan)
    Session.current().install(NotebookHooks(
        sink_factory=_sink_factory(ipython),
        timing_reporter=_ActorTiming(ipython, magics),
        traceback_rewriter=ipython_cell_names(ipython),  # remote tracebacks name cells "Cell In[3]"
        adopt_mesh=registry.adopt))  # meshes a Monarch program starts show up too
    if sidebar.register(ipython, registry):  # the JupyterLab Meshes panel talks to this comm target
        sidebar.announce(ipython)  # an open panel links up now, not at its next look
    magics.debugger = debugger.install(ipython)  # JupyterLab's debugger reaches into the ranks
    _state.update(registry=registry, magics=magics)


class _ActorTiming:
    """Per-rank timing of actor calls: one view per cell, showing its latest call.

    A loop of calls in one cell updates that view in place instead of adding one each.
    """

    def __init__(self, shell: Any, magics: MeshMagics):
        self.shell, self.magics = shell, magics
        self._cell: Any = None
        self._widget: Any = None

    def __call__(self, label: str, times: list) -> None:
        if not self.magics.timing or threading.current_thread() is not threading.main_thread():
            return
        registry = _state.get("registry")
        meshes = [registry.get(name) for name in registry.names()] if registry is not None else []
        view = run_timing_view(label, times, lambda: rank_labels(meshes))
        if view is None:
            return
        cell = getattr(self.shell, "execution_count", None)
        if getattr(self.shell, "kernel", None) is None:
            show(view)
            return
        if cell != self._cell or self._widget is None:
            from IPython.display import display

            self._cell, self._widget = cell, widget_for(view)
            display(self._widget)
        else:
            self._widget.fallback_text = view.text()
            self._widget.value = view.html()


def _display_mesh(mesh: Mesh) -> None:
    show_mesh(mesh)


def unload_ipython_extension(ipython) -> None:
    """Shut down meshes started by magics and restore plain output."""
    registry = _state.pop("registry", None)
    magics = _state.pop("magics", None)
    if registry is None:
        return
    if magics is not None:
        magics._set_auto(None)
    registry.shutdown_all()
    Session.current().uninstall()
    for shown in (Mesh, TextHtmlView):
        ipython.display_formatter.ipython_display_formatter.pop(shown, None)
    ipython.display_formatter.ipython_display_formatter.pop(".".join(PLAN_TYPE), None)
    sidebar.unregister(ipython)
    debugger.uninstall(ipython)


def current_registry() -> MeshRegistry | None:
    """The registry of the loaded extension (None when not loaded)."""
    return _state.get("registry")


def current_mesh(name: str | None = None):
    """The mesh that `%mesh` commands act on (or the named one), for use from Python."""
    registry = current_registry()
    if registry is None:
        from monarch_kernel.core.errors import MeshNotRunningError

        raise MeshNotRunningError("the extension is not loaded: run %load_ext monarch_kernel first")
    return registry.get(name)
