"""Drawing tensor layouts: text for terminals and logs, HTML for notebooks.

`visualize_sharding(mesh, "x")` describes `x` on every rank (metadata only), then shows
how it is laid out: for a DTensor, the two drawn dims cut at every shard boundary with
the ranks holding each block (each rank keeps one colour everywhere), partial blocks
marked as unreduced, empty shards listed; for a plain tensor, each rank's shape, dtype,
device and whether the values are identical; for a module, a table of its parameters.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.ranksets import format_ranks, rank_label
from monarch_kernel.core.sharding import Block, Placement, TensorDescription, TensorLayout, layout_from
from monarch_kernel.core.texttable import text_table
from monarch_kernel.views import theme
from monarch_kernel.views.base import TextHtmlView

if TYPE_CHECKING:
    from monarch_kernel.api.mesh import Mesh

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf"]


def rank_colour(rank: int) -> str:
    """The colour of a rank in every view."""
    return PALETTE[rank % len(PALETTE)]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _range(r: tuple[int, int]) -> str:
    return f"[{r[0]}:{r[1]}]"


def _facet_label(facet: dict[int, tuple[int, int]]) -> str:
    """Where a facet lies in the dims that are not drawn, e.g. `dim 0 [0:3]`."""
    return ", ".join(f"dim {d} {_range(r)}" for d, r in facet.items())


class ShardingView(TextHtmlView):
    """A tensor's layout over the mesh; shows as HTML in notebooks and text elsewhere."""

    def __init__(self, layout: TensorLayout, rows: int | None = None, cols: int | None = None):
        self.layout = layout
        ndim = len(layout.global_shape)
        self.rows = rows if rows is not None else (0 if ndim >= 1 else None)
        self.cols = cols if cols is not None else (1 if ndim >= 2 else None)
        for dim in (self.rows, self.cols):
            if dim is not None and not 0 <= dim < ndim:
                raise MeshUsageError(f"dim {dim} is out of range for the {ndim}-D tensor {layout.name}; "
                                     f"pick rows/cols among 0..{ndim - 1}")

    def label(self, rank: int) -> str:
        """`host:gpu (rank r)`."""
        return self.layout.labels.get(rank, f"rank {rank}")

    def drawable_dims(self) -> list[tuple[str, int]]:
        """(label, dim) of the tensor dims that can be drawn down or across."""
        shape = self.layout.global_shape
        return [(f"dim {d} ({shape[d]})", d) for d in range(len(shape))] if self.layout.is_dtensor else []

    def redrawn(self, rows: int, cols: int) -> ShardingView:
        """The same layout with other dims drawn."""
        return ShardingView(self.layout, rows, cols)

    def title(self) -> str:
        """The first line: what the tensor is and how it is placed."""
        lay = self.layout
        if not lay.is_dtensor:
            sums = {p.checksum for p in lay.pieces}
            shapes = {p.local_shape for p in lay.pieces}
            same = "identical on every rank" if len(sums) == 1 and len(shapes) == 1 else "different across ranks"
            return f"tensor {lay.name} on {len(lay.pieces)} ranks: values {same} (by checksum)"
        mesh = ", ".join(f"{n}={s}" for n, s in zip(lay.mesh_dim_names or
                                                       [f"dim{i}" for i in range(len(lay.mesh_shape))],
                                                       lay.mesh_shape))
        return (f"DTensor {lay.name}: {lay.dtype} {list(lay.global_shape)} over DeviceMesh ({mesh}), "
                f"placements ({', '.join(map(str, lay.placements))})")

    def axis_text(self, dim: int | None) -> str:
        """A drawn dim, named by its size and how it is split: `dim 0: 6 rows, split over dp (2)`."""
        if dim is None:
            return ""
        lay = self.layout
        names = lay.mesh_dim_names or tuple(f"dim{i}" for i in range(len(lay.mesh_shape)))
        over = [f"{name} ({size})" for name, size, p in zip(names, lay.mesh_shape, lay.placements)
                if p.kind in ("shard", "strided_shard") and p.dim == dim]
        unit = "rows" if dim == self.rows else "columns"
        return f"dim {dim}: {lay.global_shape[dim]} {unit}, " + (
            f"split over {' x '.join(over)}" if over else "not split")

    def axes_line(self, down: str = "down:", across: str = "across:") -> str:
        """Both drawn dims, each after its direction word (arrows in HTML)."""
        return "   ".join(f"{word} {self.axis_text(d)}" for word, d in ((down, self.rows), (across, self.cols))
                           if d is not None)

    def notes(self) -> list[str]:
        """What to know before reading the blocks (strided or partial placements)."""
        lay = self.layout
        notes = []
        if any(p.kind == "strided_shard" for p in lay.placements):
            notes.append("strided sharding: each rank's rows are interleaved, not one range; "
                         "below are the ranges as if contiguous")
        if lay.partial:
            notes.append(f"partial: blocks hold unreduced values ({', '.join(str(p) for p in lay.partial)}); "
                         "they sum to the tensor only after a reduction")
        return notes

    def _piece_lines(self) -> list[str]:
        return [f"{self.label(p.rank)}: {list(p.local_shape)} {p.dtype} on {p.device}, "
                f"{_bytes(p.nbytes)}, checksum {p.checksum:.6g}" for p in self.layout.pieces]

    def _footer(self) -> list[str]:
        lay = self.layout
        lines = []
        empty = lay.empty_pieces()
        if empty:
            lines.append("empty shards (no elements): " + ", ".join(self.label(p.rank) for p in empty))
        lines.append("bytes per rank: " + ", ".join(f"{p.rank}: {_bytes(p.nbytes)}" for p in lay.pieces))
        return lines

    # ------------------------------------------------------------ text
    def text(self) -> str:
        """The plain-text view."""
        lay = self.layout
        if not lay.is_dtensor:
            return "\n".join([self.title(), *("  " + line for line in self._piece_lines())])
        lines = [self.title(), *("  " + note for note in self.notes()), "  " + self.axes_line()]
        for facet in lay.facets(self.rows, self.cols):
            if facet:
                lines.append(f"  at {_facet_label(facet)}:")
            lines.extend(self._grid_text(lay.blocks(self.rows, self.cols, facet)))
        lines += ["  " + line for line in self._footer()]
        return "\n".join(lines)

    def _grid_text(self, grid: list[list[Block]]) -> list[str]:
        partial = " partial" if self.layout.partial else ""
        head = [f"dim {self.cols} {_range(b.cols)}" if self.cols is not None else "" for b in grid[0]]
        body = [[f"dim {self.rows} {_range(line[0].rows)}" if self.rows is not None else ""]
                + [self._holders(b) + partial for b in line] for line in grid]
        return text_table([[""] + head] + body, indent="    ")

    def _slice_text(self, b: Block) -> str:
        """The block's global slice, e.g. `w[0:3, 4:8]` (dims not drawn: whole, or the facet's)."""
        shape = self.layout.global_shape
        parts = [f"{b.rows[0]}:{b.rows[1]}" if d == self.rows else f"{b.cols[0]}:{b.cols[1]}" if d == self.cols
                 else f"0:{n}" for d, n in enumerate(shape)]
        return f"{self.layout.name}[{', '.join(parts)}]"

    def _block_bytes(self, b: Block) -> int:
        """Bytes of the block's elements (the other dims taken whole)."""
        shape = self.layout.global_shape
        elements = 1
        for d, n in enumerate(shape):
            elements *= (b.rows[1] - b.rows[0]) if d == self.rows else (b.cols[1] - b.cols[0]) if d == self.cols else n
        sized = next((p for p in self.layout.pieces if math.prod(p.local_shape)), None)
        return elements * (sized.nbytes // math.prod(sized.local_shape)) if sized else 0

    def _holders(self, block: Block) -> str:
        if not block.ranks:
            return "(nobody)"
        if len(block.ranks) == 1:
            return self.label(block.ranks[0])
        return f"ranks {format_ranks(block.ranks)} (replicated)"

    # ------------------------------------------------------------ HTML
    def html(self) -> str:
        """The HTML view: blocks sized by their extents, coloured by rank."""
        lay = self.layout
        if not lay.is_dtensor:
            rows = "".join(
                f"<tr><td>{theme.swatch(rank_colour(p.rank))}{html.escape(self.label(p.rank))}</td>"
                f"<td>{list(p.local_shape)}</td><td>{p.dtype}</td><td>{html.escape(p.device)}</td>"
                f"<td>{_bytes(p.nbytes)}</td><td>{p.checksum:.6g}</td></tr>" for p in lay.pieces)
            caption = html.escape(self.title())
            return (f"<div class='mk-sharding' style='color:{theme.TEXT}'><b>{caption}</b><table><tr><th>rank</th><th>shape</th>"
                    f"<th>dtype</th><th>device</th><th>bytes</th><th>checksum</th></tr>{rows}</table></div>")
        parts = [f"<div class='mk-sharding' style='color:{theme.TEXT};font-family:{theme.FONT}'>"
                 f"<b>{html.escape(self.title())}</b>"]
        parts += [f"<div><i>{html.escape(note)}</i></div>" for note in self.notes()]
        axes = html.escape(self.axes_line("\u2193", "\u2192"))
        parts.append(f"<div class='mk-axes' style='font:11px {theme.FONT}'>{axes}</div>")
        for facet in lay.facets(self.rows, self.cols):
            if facet:
                parts.append(f"<div>at {html.escape(_facet_label(facet))}</div>")
            parts.append(self._grid_html(lay.blocks(self.rows, self.cols, facet)))
        empty = lay.empty_pieces()
        if empty:
            parts.append("<div class='mk-empty'>empty shards (no elements): " + ", ".join(
                f"<span>{theme.swatch(rank_colour(p.rank))}{html.escape(self.label(p.rank))}</span>"
                for p in empty) + "</div>")
        parts.append("<div class='mk-legend'>bytes per rank: " + ", ".join(
            f"<span>{theme.swatch(rank_colour(p.rank))}{p.rank}: {_bytes(p.nbytes)}</span>" for p in lay.pieces)
            + "</div></div>")
        return "".join(parts)

    def _grid_html(self, grid: list[list[Block]]) -> str:
        total_w = sum(b.cols[1] - b.cols[0] for b in grid[0]) or 1
        total_h = sum(line[0].rows[1] - line[0].rows[0] for line in grid) or 1
        cols = " ".join(f"{max(1, round(360 * (b.cols[1] - b.cols[0]) / total_w))}px" for b in grid[0])
        rows = " ".join(f"{max(24, round(200 * (line[0].rows[1] - line[0].rows[0]) / total_h))}px" for line in grid)
        label = f"font:10px {theme.MONO};color:{theme.TEXT};align-self:center"
        cells = ["<div></div>"] + [
            f"<div style='{label};text-align:center'>{f'dim {self.cols} {_range(b.cols)}' if self.cols is not None else ''}</div>"
            for b in grid[0]]
        for line in grid:
            row_label = f"dim {self.rows} {_range(line[0].rows)}" if self.rows is not None else ""
            cells.append(f"<div style='{label};text-align:right;padding-right:4px'>{row_label}</div>")
            cells.extend(self._block_html(b) for b in line)
        return (f"<div class='mk-grid' style='display:grid;justify-content:start;grid-template-columns:max-content {cols};"
                f"grid-template-rows:auto {rows};gap:2px;margin:4px 0'>{''.join(cells)}</div>")

    def _block_html(self, b: Block) -> str:
        colours = [rank_colour(r) for r in b.ranks] or ["#dddddd"]
        if len(colours) == 1:
            background = f"linear-gradient({colours[0]}, {colours[0]})"  # an image layer, so a hatch can lie over it
        else:
            step = 100 / len(colours)
            stops = ", ".join(f"{c} {i * step:.0f}% {(i + 1) * step:.0f}%" for i, c in enumerate(colours))
            background = f"linear-gradient(135deg, {stops})"
        partial = bool(self.layout.partial)
        # a Partial (unreduced) tensor: light stripes over the ranks' colours
        hatch = "repeating-linear-gradient(45deg, rgba(255,255,255,.35) 0 6px, transparent 6px 12px), " if partial else ""
        ops = ", ".join(str(p) for p in self.layout.partial)
        title = (f"{self._slice_text(b)}: {self._holders(b)}, {_bytes(self._block_bytes(b))} per holder"
                 + (f" - unreduced, {ops} (each holder has a partial value; the sum is the tensor)" if partial else ""))
        text = self._holders(b) + (f" &Sigma; {html.escape(ops)}" if partial else "")
        ink = theme.text_on(*colours, *([theme.lighter(c, 0.35) for c in colours] if partial else []))
        return (f"<div class='mk-block' data-ranks='{','.join(map(str, b.ranks))}' "
                f"data-rows='{b.rows[0]}:{b.rows[1]}' data-cols='{b.cols[0]}:{b.cols[1]}' title='{html.escape(title)}' "
                f"style='background:{hatch}{background};color:{ink};font:11px {theme.FONT};padding:2px;"
                f"overflow:hidden'>{text}</div>")

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = [Text(self.title(), style="bold")]
        if not self.layout.is_dtensor:
            parts += [Text("  " + line) for line in self._piece_lines()]
            return Group(*parts)
        parts += [Text("  " + note) for note in self.notes()] + [Text("  " + self.axes_line(), style="dim")]
        for facet in self.layout.facets(self.rows, self.cols):
            grid = self.layout.blocks(self.rows, self.cols, facet)
            title = ("at " + ", ".join(f"dim {d} {_range(r)}" for d, r in facet.items())) if facet else None
            table = Table(title=title, show_lines=True)
            table.add_column("")
            for b in grid[0]:
                table.add_column(f"dim {self.cols} {_range(b.cols)}" if self.cols is not None else "")
            for line in grid:
                label = f"dim {self.rows} {_range(line[0].rows)}" if self.rows is not None else ""
                cells = [Text(self._holders(b) + (" partial" if self.layout.partial else ""),
                              style=rank_colour(b.ranks[0]) if len(b.ranks) == 1 else "bold") for b in line]
                table.add_row(label, *cells)
            parts.append(table)
        parts += [Text("  " + line) for line in self._footer()]
        return Group(*parts)


@dataclass(frozen=True)
class ParameterRow:
    """One parameter of a module: how it is placed and what each rank holds."""

    name: str
    global_shape: tuple[int, ...]
    placements: str
    bytes_per_rank: dict[int, int]

    @property
    def total(self) -> int:
        """Bytes over all ranks."""
        return sum(self.bytes_per_rank.values())


class ModuleShardingView(TextHtmlView):
    """A module's parameters over the mesh (an FSDP2 / DTensor-parameter model)."""

    def __init__(self, name: str, rows: list[ParameterRow]):
        self.name = name
        self.rows = rows

    def drawable_dims(self) -> list[tuple[str, int]]:
        """A table of parameters has no dims to pick."""
        return []

    def title(self) -> str:
        """How many parameters, and their bytes."""
        return (f"module {self.name}: {len(self.rows)} parameters, "
                f"{_bytes(sum(r.total for r in self.rows))} over all ranks")

    def text(self) -> str:
        """The plain-text table."""
        head = ["parameter", "global shape", "placements", "bytes per rank", "total"]
        body = [[r.name, str(list(r.global_shape)), r.placements,
                 ", ".join(f"{k}: {_bytes(v)}" for k, v in sorted(r.bytes_per_rank.items())), _bytes(r.total)]
                for r in self.rows]
        return "\n".join([self.title(), *text_table([head] + body, indent="  ")])

    def html(self) -> str:
        """The HTML table."""
        rows = "".join(
            f"<tr><td>{html.escape(r.name)}</td><td>{list(r.global_shape)}</td><td>{html.escape(r.placements)}</td>"
            f"<td>{', '.join(f'{k}: {_bytes(v)}' for k, v in sorted(r.bytes_per_rank.items()))}</td>"
            f"<td>{_bytes(r.total)}</td></tr>"
            for r in self.rows)
        return (f"<div class='mk-sharding'><b>{html.escape(self.title())}</b><table><tr>"
                "<th>parameter</th><th>global shape</th><th>placements</th><th>bytes per rank</th><th>total</th></tr>"
                f"{rows}</table></div>")


def visualize_sharding(mesh: Mesh, expr: str, *, rows: int | None = None,
                       cols: int | None = None) -> ShardingView | ModuleShardingView:
    """Show how `expr` (evaluated on every rank: a DTensor, a tensor or a module) lies on the mesh.

    Only metadata crosses the wire; `rows`/`cols` pick the two tensor dims to draw.
    """
    described = list(mesh.describe(expr).values())
    labels = {s.rank: rank_label(s.host, s.local_rank, s.rank) for s in mesh.status()}
    if described and isinstance(described[0], list):
        return _module_view(expr, described)
    return ShardingView(layout_from(expr, described, labels), rows, cols)


def _module_view(name: str, described: list[list[tuple[str, TensorDescription]]]) -> ModuleShardingView:
    """Parameters matched by name across ranks (a pipeline stage holds only its own), in the
    order the ranks list them; each row names the ranks that hold the parameter."""
    by_name: dict[str, tuple[TensorDescription, dict[int, int]]] = {}
    for listed in described:
        for pname, info in listed:
            first, per_rank = by_name.setdefault(pname, (info, {}))
            per_rank[info.rank] = info.nbytes
    rows = []
    for pname, (first, per_rank) in by_name.items():
        placements = (", ".join(str(Placement(*p)) for p in first.placements)
                      if first.kind == "dtensor" else "local tensor")
        rows.append(ParameterRow(pname, first.global_shape, placements, dict(sorted(per_rank.items()))))
    return ModuleShardingView(name, rows)

