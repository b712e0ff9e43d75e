"""The mesh at a glance: a grid of ranks with state and load, as text, HTML and rich.

`mesh_snapshot(mesh)` is the model (what to draw); `snapshot_text`, `snapshot_html` and
`snapshot_rich` draw it, `MeshView` holds one for display, and the live widget
(`widgets.MeshWidget`) draws the same cells.
The grid puts the last mesh dim across and every other dim down (1-D meshes are one
row; 3-D meshes get one row per combination of the leading dims).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monarch_kernel.core.ranksets import rank_label
from monarch_kernel.core.status import RankStatus, allocation_is_short
from monarch_kernel.core.texttable import text_table
from monarch_kernel.views import theme
from monarch_kernel.views.base import TextHtmlView

if TYPE_CHECKING:
    from monarch_kernel.api.mesh import Mesh

ALLOCATION_MAX_AGE_S = 5.0  # a redrawn view asks the scheduler at most this often
STATE_COLOURS: dict[str, str] = {state: colour for state, (colour, _glyph) in theme.STATES.items()}


@dataclass(frozen=True)
class RankCell:
    """Everything one rank's cell shows."""

    rank: int
    coords: tuple[tuple[str, int], ...]
    host: str
    local_rank: int
    pid: int | None
    state: str
    detail: str
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    gpu_used_bytes: int | None = None
    gpu_total_bytes: int | None = None
    gpu_util_percent: float | None = None
    host_memory_bytes: int | None = None

    @property
    def label(self) -> str:
        """`host:gpu (rank r)`."""
        return rank_label(self.host, self.local_rank, self.rank)

    def load_text(self, with_gpu: bool) -> str:
        """CPU, memory and (when there is a GPU) GPU memory and utilization."""
        if self.cpu_percent is None:
            return ""
        parts = [f"cpu {self.cpu_percent:.0f}%", f"rss {_mib(self.rss_bytes)}"]
        if with_gpu and self.gpu_total_bytes:
            parts.append(f"gpu {_mib(self.gpu_used_bytes)}/{_mib(self.gpu_total_bytes)} "
                         f"{self.gpu_util_percent or 0:.0f}%")
        return ", ".join(parts)


@dataclass(frozen=True)
class MeshSnapshot:
    """The grid to draw: row labels, column labels, and the cells row by row."""

    title: str
    row_labels: tuple[str, ...]
    col_labels: tuple[str, ...]
    rows: tuple[tuple[RankCell, ...], ...]
    has_gpu: bool
    allocation: str | None = None  # the scheduler's job: id, state, time left (Slurm meshes)

    def cells(self) -> list[RankCell]:
        """Every cell, row-major."""
        return [c for row in self.rows for c in row]


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / (1 << 30):.1f} GiB" if n >= (1 << 30) else f"{n / (1 << 20):.0f} MiB"


def _detail(s: Any) -> str:
    if s.state == RankStatus.DEAD:
        return str(s.exit_text)
    if s.state == RankStatus.BUSY:
        what = s.busy_with or "work"
        busy = f"{what} for {s.busy_for_s:.1f} s" if s.busy_for_s is not None else what
        return f"{busy}, {s.collective}" if s.collective else busy
    if s.state == RankStatus.UNRESPONSIVE:
        return "no heartbeat"
    return ""


def mesh_snapshot(mesh: Mesh, title_suffix: str = "") -> MeshSnapshot:
    """The model of the view, from the mesh's current rank states and loads."""
    status = {s.rank: s for s in mesh.status()}
    dims = list(mesh.shape.dims)
    points = list(mesh.shape.points())
    cols = dims[-1][1] if dims else 1
    cells = []
    for point in points:
        s = status[point.rank]
        load = s.load
        cells.append(RankCell(
            point.rank, tuple(point.items()), s.host, s.local_rank, s.pid, s.state, _detail(s),
            *((load.cpu_percent, load.rss_bytes, load.gpu_used_bytes, load.gpu_total_bytes, load.gpu_util_percent,
               load.host_memory_bytes) if load is not None else ())))
    rows = tuple(tuple(cells[i:i + cols]) for i in range(0, len(cells), cols))
    leading = dims[:-1]
    if [name for name, _ in dims] == ["hosts", "gpus"]:  # the usual mesh: host names down, GPU indices across
        row_labels = tuple(row[0].host for row in rows)
        col_labels = tuple(f"GPU {i}" for i in range(cols))
    else:
        row_labels = tuple(", ".join(f"{name}={value}" for (name, _), (_, value) in zip(leading, row[0].coords))
                           for row in rows) if leading else ("",) * len(rows)
        col_labels = tuple(f"{dims[-1][0]}={i}" for i in range(cols)) if dims else ("",)
    title = (f"mesh {mesh.name!r} {mesh.shape} dist={mesh.backend}" + title_suffix
             + (": shut down" if mesh.closed else ""))
    allocation = None if mesh.closed else mesh.allocation_line(ALLOCATION_MAX_AGE_S)
    return MeshSnapshot(title, row_labels, col_labels, rows, any(c.gpu_total_bytes for c in cells), allocation)


def snapshot_text(snap: MeshSnapshot) -> str:
    """One line per rank: label, coordinates, pid, state, detail, load."""
    lines = [snap.title] + ([snap.allocation] if snap.allocation else [])
    table = [("rank", "coords", "pid", "state", "detail", "load")]
    for c in snap.cells():
        table.append((c.label, ", ".join(f"{k}={v}" for k, v in c.coords), str(c.pid or "-"),
                      c.state, c.detail, c.load_text(snap.has_gpu)))
    return "\n".join(lines + text_table(table))


def cell_html(c: RankCell, has_gpu: bool) -> str:
    """One rank's tile: the theme's card, its state as a badge (glyph and word), what it does, its load."""
    colour = theme.state_colour(c.state)
    detail = html.escape(c.detail)
    return (f"<div class='mk-rank' data-rank='{c.rank}' data-state='{c.state}' "
            f"style='border-left:6px solid {colour};padding:3px 6px;font:11px {theme.FONT};background:{theme.CARD};"
            f"color:{theme.TEXT}'>"
            f"<b>{html.escape(c.label)}</b> {theme.state_badge(c.state)}<br>"
            f"<span class='mk-rank-detail'>pid {c.pid or '-'} {detail}</span>{_load_bars(c, has_gpu)}</div>")


def _load_bars(c: RankCell, has_gpu: bool) -> str:
    """CPU, memory (of the host's), and GPU memory and utilization as small labelled bars;
    nothing before the first load report."""
    if c.cpu_percent is None:
        return ""
    memory = 100 * (c.rss_bytes or 0) / c.host_memory_bytes if c.host_memory_bytes else None
    bars = [("cpu", min(100.0, c.cpu_percent), f"{c.cpu_percent:.0f}%"), ("mem", memory, _mib(c.rss_bytes))]
    if has_gpu and c.gpu_total_bytes:
        used = 100 * (c.gpu_used_bytes or 0) / c.gpu_total_bytes
        bars += [("gpu", used, f"{_mib(c.gpu_used_bytes)}/{_mib(c.gpu_total_bytes)}"),
                 ("util", c.gpu_util_percent or 0.0, f"{c.gpu_util_percent or 0:.0f}%")]
    out = []
    for name, percent, text in bars:
        track = " " if percent is None else (
            f"<span class='mk-bar' style='display:inline-block;width:40px;height:6px;background:{theme.TRACK};"
            f"margin:0 4px;vertical-align:middle'><span style='display:block;height:6px;"
            f"width:{max(2.0, min(100.0, percent)):.0f}%;background:{theme.TEXT}'></span></span>")
        out.append(f"<span class='mk-load' style='white-space:nowrap'>{name}{track}{html.escape(text)}</span>")
    return "<br>" + " ".join(out)


COLLAPSE_ROWS = 8  # beyond this many rows, each row starts folded into its summary line


def summary(cells: list[RankCell]) -> str:
    """`3 busy, 1 idle; rss 1.2 GiB`: states by count, and memory in all."""
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.state] = counts.get(c.state, 0) + 1
    states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda item: -item[1]))
    rss = sum(c.rss_bytes or 0 for c in cells)
    return states + (f"; rss {_mib(rss)}" if rss else "")


def snapshot_html(snap: MeshSnapshot) -> str:
    """The grid as HTML: a tile per rank, a summary per row and for the mesh; rows fold when there are many."""
    head = "<th></th>" + "".join(f"<th>{html.escape(x)}</th>" for x in snap.col_labels)
    fold = len(snap.rows) > COLLAPSE_ROWS
    rows = []
    for label, row in zip(snap.row_labels, snap.rows):
        name = (f"<b>{html.escape(label)}</b><br><span class='mk-row-summary' style='font-weight:normal'>"
                f"{html.escape(summary(list(row)))}</span>")
        tiles = "".join(f"<td>{cell_html(c, snap.has_gpu)}</td>" for c in row)
        if fold:  # one line per row, opened on a click (no script: <details>)
            rows.append(f"<tr><th style='text-align:left;vertical-align:top'>{name}</th><td colspan='{len(row)}'>"
                        f"<details class='mk-row'><summary>{len(row)} ranks</summary><table><tr>{tiles}</tr></table>"
                        "</details></td></tr>")
        else:
            rows.append(f"<tr><th style='text-align:left;vertical-align:top'>{name}</th>{tiles}</tr>")
    header = "" if fold else f"<tr>{head}</tr>"
    return (f"<div class='mk-mesh' style='color:{theme.TEXT};font-family:{theme.FONT}'>"
            f"<b>{html.escape(snap.title)}</b>{allocation_html(snap.allocation)}"
            f"<div class='mk-mesh-summary'>{len(snap.cells())} ranks: {html.escape(summary(snap.cells()))}</div>"
            f"<table>{header}{''.join(rows)}</table></div>")


def allocation_html(line: str | None) -> str:
    """The scheduler's job line, in warning colours when its time is nearly up ("" without one)."""
    if not line:
        return ""
    text = theme.badge(html.escape(line), theme.WARNING) if allocation_is_short(line) else html.escape(line)
    return f"<div class='mk-allocation' style='color:{theme.TEXT};font:12px {theme.FONT}'>{text}</div>"


def snapshot_rich(snap: MeshSnapshot) -> Any:
    """The grid as a rich Table (terminals)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(show_lines=True)
    table.add_column("")
    for label in snap.col_labels:
        table.add_column(label)
    for label, row in zip(snap.row_labels, snap.rows):
        cells = []
        for c in row:
            text = Text(c.label + "\n", style="bold")
            text.append(c.state, style=f"bold {STATE_COLOURS.get(c.state, 'white')}")
            text.append(f"  pid {c.pid or '-'} {c.detail}\n{c.load_text(snap.has_gpu)}")
            cells.append(text)
        table.add_row(label, *cells)
    head = [Text(snap.title, style="bold")]  # the title never wraps into the table
    if snap.allocation:
        head.append(Text(snap.allocation, style="bold red" if allocation_is_short(snap.allocation) else "dim"))
    return Group(*head, table)


class MeshView(TextHtmlView):
    """A static picture of the mesh (text, HTML, rich); the live one is `widgets.MeshWidget`."""

    def __init__(self, mesh: Mesh, title_suffix: str = ""):
        self.mesh = mesh
        self.title_suffix = title_suffix
        self.snapshot = mesh_snapshot(mesh, title_suffix)

    def text(self) -> str:
        """One line per rank."""
        return snapshot_text(self.snapshot)

    def html(self) -> str:
        """The grid of rank cards."""
        return snapshot_html(self.snapshot)

    def __rich__(self) -> Any:
        return snapshot_rich(self.snapshot)
