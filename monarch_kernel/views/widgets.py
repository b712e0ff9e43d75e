"""The live widgets of the views (ipywidgets; the notebook's process only).

`MeshWidget` is the mesh grid that updates while cells run; `ShardingWidget` and
`TimingWidget` keep a view's picture in the widget model, so a notebook saved with widget
state shows them again, and a frontend without widgets shows the text view instead.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from monarch_kernel.views.meshview import COLLAPSE_ROWS, allocation_html, cell_html, mesh_snapshot, snapshot_text, summary

if TYPE_CHECKING:
    from monarch_kernel.api.mesh import Mesh

REFRESH_S = 0.5
MAX_LIVE = 4  # older views stop updating (each live view takes a snapshot twice a second)


class MeshWidget(widgets.VBox):
    """A mesh's ranks in a grid (hosts down, gpus across), live."""

    _live: list[MeshWidget] = []

    def __init__(self, mesh: Mesh, refresh_s: float = REFRESH_S, log_lines: int = 20, title_suffix: str = ""):
        self._mesh = mesh
        self._log_lines = log_lines
        self._suffix = title_suffix
        snap = mesh_snapshot(mesh, title_suffix)
        self._has_gpu = snap.has_gpu
        self._title = widgets.HTML(f"<b>{html.escape(snap.title)}</b>")
        self._allocation = widgets.HTML(allocation_html(snap.allocation))
        self._summary = widgets.HTML(self._summary_html(snap))
        self.cards: dict[int, widgets.HTML] = {}
        self._row_heads: list[widgets.HTML] = []
        self._folded: widgets.Accordion | None = None
        columns = f"repeat({len(snap.col_labels)}, minmax(190px, 1fr))"
        if len(snap.rows) > COLLAPSE_ROWS:  # many hosts: one folded section per host, titled by its summary
            sections = [widgets.GridBox([self._tile(cell, snap.has_gpu) for cell in row],
                                        layout=widgets.Layout(grid_template_columns=columns, grid_gap="4px"))
                        for row in snap.rows]
            self._folded = widgets.Accordion(children=sections, selected_index=None)
            for i, (label, row) in enumerate(zip(snap.row_labels, snap.rows)):
                self._folded.set_title(i, f"{label}: {summary(list(row))}")
            grid: widgets.Widget = self._folded
        else:
            children: list[widgets.Widget] = [widgets.HTML("")]
            children += [widgets.HTML(f"<b>{html.escape(label)}</b>") for label in snap.col_labels]
            for label, row in zip(snap.row_labels, snap.rows):
                head = widgets.HTML(self._row_html(label, list(row)))
                self._row_heads.append(head)
                children.append(head)
                children += [self._tile(cell, snap.has_gpu) for cell in row]
            grid = widgets.GridBox(children, layout=widgets.Layout(grid_template_columns=f"auto {columns}",
                                                                   grid_gap="4px"))
        self.output = widgets.Output()
        super().__init__([self._title, self._allocation, self._summary, grid, self.output])
        self._text = snapshot_text(snap)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, args=(refresh_s,), name="mesh-widget", daemon=True)
        self._thread.start()
        MeshWidget._live.append(self)
        while len(MeshWidget._live) > MAX_LIVE:
            MeshWidget._live.pop(0)._stop.set()

    def _tile(self, cell: Any, has_gpu: bool) -> widgets.Widget:
        """A rank's card and its output button."""
        card = widgets.HTML(cell_html(cell, has_gpu))
        button = widgets.Button(description="output", tooltip=f"what rank {cell.rank} printed lately",
                                layout=widgets.Layout(width="70px", height="22px"))
        button.on_click(lambda _b, rank=cell.rank: self.show_output(rank))
        self.cards[cell.rank] = card
        return widgets.VBox([card, button])

    @staticmethod
    def _row_html(label: str, row: list[Any]) -> str:
        return f"<b>{html.escape(label)}</b><br><span style='font-size:11px'>{html.escape(summary(row))}</span>"

    @staticmethod
    def _summary_html(snap: Any) -> str:
        return f"<span style='font-size:12px'>{len(snap.cells())} ranks: {html.escape(summary(snap.cells()))}</span>"

    def refresh(self) -> int:
        """Take a snapshot and update the cards that changed; returns how many did."""
        snap = mesh_snapshot(self._mesh, self._suffix)
        self._text = snapshot_text(snap)
        changed = 0
        for cell in snap.cells():
            card = self.cards.get(cell.rank)
            value = cell_html(cell, self._has_gpu or snap.has_gpu)
            if card is not None and card.value != value:
                card.value = value
                changed += 1
        if self._title.value != f"<b>{html.escape(snap.title)}</b>":
            self._title.value = f"<b>{html.escape(snap.title)}</b>"
        if self._allocation.value != allocation_html(snap.allocation):
            self._allocation.value = allocation_html(snap.allocation)
        if self._summary.value != self._summary_html(snap):
            self._summary.value = self._summary_html(snap)
        for i, (label, row) in enumerate(zip(snap.row_labels, snap.rows)):
            if i < len(self._row_heads) and self._row_heads[i].value != self._row_html(label, list(row)):
                self._row_heads[i].value = self._row_html(label, list(row))
            if self._folded is not None and i < len(self._folded.children):
                title = f"{label}: {summary(list(row))}"
                if self._folded.get_title(i) != title:
                    self._folded.set_title(i, title)
        return changed

    def show_output(self, rank: int) -> None:
        """Show the last lines rank `rank` printed, below the grid."""
        self.output.clear_output()
        with self.output:
            print(f"rank {rank}, last {self._log_lines} lines:")
            for stream, line in self._mesh.logs(rank, self._log_lines):
                print(("! " if stream == "stderr" else "  ") + line)

    def _follow(self, refresh_s: float) -> None:
        while not self._stop.wait(refresh_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a closed comm or a mesh going away ends the view
                return
            if self._mesh.closed:
                return

    def close(self) -> None:
        """Stop updating and close the widget."""
        self._stop.set()
        super().close()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = self._text  # what a frontend without widgets shows
        return bundle


class _TextFallback:
    """Mixin: a frontend without widgets shows this text."""

    fallback_text = ""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}  # type: ignore[misc]
        bundle["text/plain"] = self.fallback_text
        return bundle


class ShardingWidget(_TextFallback, widgets.VBox):
    """A DTensor's layout; dropdowns pick the two tensor dims to draw (no round trip to ranks)."""

    def __init__(self, view: Any):
        self.view = view
        self.picture = widgets.HTML(view.html())
        self.fallback_text = view.text()
        children: list[widgets.Widget] = []
        dims = view.drawable_dims()  # (label, dim) of each tensor dim the view can draw down or across
        if len(dims) >= 2:
            self.rows = widgets.Dropdown(options=dims, value=view.rows, description="rows")
            self.cols = widgets.Dropdown(options=dims, value=view.cols, description="cols")
            self.rows.observe(self._redraw, "value")
            self.cols.observe(self._redraw, "value")
            children.append(widgets.HBox([self.rows, self.cols]))
        super().__init__([*children, self.picture])

    def _redraw(self, _change: Any) -> None:
        if self.rows.value == self.cols.value:
            return
        self.view = self.view.redrawn(self.rows.value, self.cols.value)
        self.picture.value = self.view.html()
        self.fallback_text = self.view.text()


class TimingWidget(_TextFallback, widgets.HTML):
    """Per-rank timing bars of one run."""

    def __init__(self, view: Any):
        self.fallback_text = view.text()
        super().__init__(view.html())


class PlanWidget(_TextFallback, widgets.VBox):
    """A plan's table and bars; on a live mesh, a layout to pick and buttons to trial and apply."""

    def __init__(self, view: Any):
        self.view = view
        self.picture = widgets.HTML(view.html())
        self.fallback_text = view.text()
        self.status = widgets.HTML("")
        children: list[widgets.Widget] = [self.picture]
        plan = view.plan
        if plan.mesh is not None:
            usable = [c.layout for c in plan.candidates if c.applicable]
            best = plan.best.layout if plan.best else (usable[0] if usable else None)
            self.choice = widgets.Dropdown(options=usable, value=best, description="layout")
            self.trial_button = widgets.Button(description="Trial fitting layouts", icon="stopwatch")
            self.apply_button = widgets.Button(description="Apply", icon="check", button_style="primary")
            self.trial_button.on_click(self._trial)
            self.apply_button.on_click(self._apply)
            children.append(widgets.HBox([self.choice, self.apply_button, self.trial_button]))
        super().__init__([*children, self.status])

    def _redraw(self) -> None:
        self.picture.value = self.view.html()
        self.fallback_text = self.view.text()
        if hasattr(self, "choice") and self.view.plan.best is not None:
            self.choice.value = self.view.plan.best.layout

    def _run(self, doing: str, action: Any) -> None:
        self.status.value = html.escape(f"{doing} ...")
        try:
            done = action()
        except Exception as exc:  # noqa: BLE001 - a failed trial or apply is said here; the plan stays usable
            self.status.value = f"<b>{html.escape(doing)} failed:</b> {html.escape(f'{type(exc).__name__}: {exc}')}"
            return
        self._redraw()
        self.status.value = html.escape(done)

    def _trial(self, _button: Any = None) -> None:
        plan = self.view.plan
        self._run("running the fitting layouts", lambda: (
            plan.trial(), f"trialled; fastest measured: {plan.best.layout if plan.best else 'none'}")[1])

    def _apply(self, _button: Any = None) -> None:
        plan, layout = self.view.plan, self.choice.value

        def apply() -> str:
            plan.apply(layout)
            return f"applied {layout}: model, optimizer and train_step(batch) are bound on every rank"

        self._run(f"applying {layout}", apply)
