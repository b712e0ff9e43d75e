"""How views are shown: a live widget in a kernel, rich in a terminal, the MIME bundle elsewhere.

The magics and the IPython extension call these; the views themselves only draw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from monarch_kernel.core.ranksets import rank_label
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.views.base import TextHtmlView
from monarch_kernel.views.meshview import MeshView
from monarch_kernel.views.planview import PlanView
from monarch_kernel.views.shardview import ModuleShardingView, ShardingView
from monarch_kernel.views.timing import TimingView, run_timing_view

if TYPE_CHECKING:
    from monarch_kernel.api.mesh import Mesh


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def widget_for(view: TextHtmlView) -> Any:
    """The live widget that shows a view, or None (a closed mesh, a view without one)."""
    from monarch_kernel.views import widgets

    if isinstance(view, MeshView):
        return None if view.mesh.closed else widgets.MeshWidget(view.mesh, title_suffix=view.title_suffix)
    if isinstance(view, (ShardingView, ModuleShardingView)):
        return widgets.ShardingWidget(view)
    if isinstance(view, TimingView):
        return widgets.TimingWidget(view)
    if isinstance(view, PlanView):
        return widgets.PlanWidget(view)
    return None


def show(view: TextHtmlView) -> None:
    """Display a view: its widget in a kernel, rich in a terminal IPython, text and HTML otherwise."""
    from IPython.display import display

    shell = _shell()
    widget = widget_for(view) if shell is not None and getattr(shell, "kernel", None) is not None else None
    if widget is not None:
        display(widget)
    elif shell is not None and getattr(shell, "kernel", None) is None and hasattr(view, "__rich__"):
        from rich.console import Console

        Console().print(view)
    else:
        display(view._repr_mimebundle_(), raw=True)


def show_plan(plan: Any) -> None:
    """A plan as a cell's value: its widget in a notebook (trial and apply buttons on a mesh)."""
    show(PlanView(plan))


def show_mesh(mesh: Mesh, *, default: bool = False) -> None:
    """`%mesh status`: the live grid in a notebook, a rich grid in a terminal, a table elsewhere."""
    show(MeshView(mesh, title_suffix=" (default)" if default else ""))


def rank_labels(meshes: list[Mesh]) -> dict[int, str]:
    """`host:gpu (rank r)` of every rank of these meshes."""
    return {s.rank: rank_label(s.host, s.local_rank, s.rank) for mesh in meshes for s in mesh.status()}


def show_run_timing(title: str, times: list[RankTiming], meshes: list[Mesh]) -> None:
    """Per-rank bars of a finished run, when it is worth showing (see `timing.run_timing_view`)."""
    view = run_timing_view(title, times, lambda: rank_labels(meshes))
    if view is not None:
        show(view)
