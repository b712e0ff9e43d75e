"""ValueMesh: one value per point of a mesh (or slice), addressed by coordinates."""

from __future__ import annotations

import html
from collections.abc import Iterator
from typing import Generic, TypeVar

from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.shape import MeshShaped, Point, Shape
from monarch_kernel.core.texttable import text_table

T = TypeVar("T")
_MAX_CELL = 80


class ValueMesh(MeshShaped, Generic[T]):
    """Values by mesh coordinates, e.g. the last expression of a cell on every rank.

    >>> vm.item(hosts=0, gpus=2)      # one value
    >>> [v for v in vm.values()]      # all values, row-major
    >>> dict((p.rank, v) for p, v in vm.items())
    """

    def __init__(self, shape: Shape, values: list[T]):
        if len(values) != len(shape):
            raise ValueError(f"{len(values)} values for a shape of {len(shape)} points")
        self.shape = shape
        self._values = list(values)

    def item(self, **coords: int) -> T:
        """The value at the given coordinates (every dim named, e.g. hosts=0, gpus=2)."""
        if not coords and len(self._values) == 1:
            return self._values[0]
        return self._values[self.shape.index_of(**coords)]

    def values(self) -> Iterator[T]:
        """Every value, in row-major order of the shape."""
        return iter(self._values)

    def items(self) -> Iterator[tuple[Point, T]]:
        """(Point, value) pairs; a Point maps dim names to coordinates and has .rank."""
        return zip(self.shape.points(), self._values)

    def get(self, index: int) -> T:
        """The value at row-major position `index` of this (sliced) shape."""
        return self._values[index]

    def _with(self, shape: Shape) -> ValueMesh[T]:  # (slices, and the same ranks re-shaped)
        position = {rank: i for i, rank in enumerate(self.shape.ranks)}
        return ValueMesh(shape, [self._values[position[r]] for r in shape.ranks])

    def by_rank(self) -> dict[int, T]:
        """Values keyed by global rank."""
        return {p.rank: v for p, v in self.items()}

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[tuple[Point, T]]:
        return self.items()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueMesh) and self.shape == other.shape and self._values == other._values

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------ display
    def _cells(self) -> list[str]:
        return [_short(repr(v)) for v in self._values]

    def __repr__(self) -> str:
        cells = self._cells()
        distinct = set(cells)
        head = f"ValueMesh({self.shape}"
        if len(distinct) == 1 and len(cells) > 1:
            return f"{head}, all ranks: {cells[0]})"
        if len(self.shape.dims) == 2 and "\n" not in "".join(cells):
            return head + ")\n" + _grid_text(self.shape, cells)
        rows = [f"  {_label(p)}: {c}" for p, c in zip(self.shape.points(), cells)]
        return head + ")\n" + "\n".join(rows)

    def _repr_html_(self) -> str:
        cells = [html.escape(c) for c in self._cells()]
        points = list(self.shape.points())
        title = html.escape(f"ValueMesh {self.shape}")
        if len(self.shape.dims) == 2:
            (rname, rn), (cname, cn) = self.shape.dims
            head = "".join(f"<th>{cname} {j}</th>" for j in range(cn))
            body = "".join(
                f"<tr><th>{rname} {i}</th>" + "".join(
                    f"<td title='rank {points[i * cn + j].rank}'><code>{cells[i * cn + j]}</code></td>"
                    for j in range(cn)) + "</tr>"
                for i in range(rn))
            table = f"<tr><th></th>{head}</tr>{body}"
        else:
            table = "<tr><th>rank</th><th>coords</th><th>value</th></tr>" + "".join(
                f"<tr><td>{p.rank}</td><td>{html.escape(_coords(p))}</td><td><code>{c}</code></td></tr>"
                for p, c in zip(points, cells))
        return (f"<div class='monarch-value-mesh'><div><b>{title}</b> "
                f"<small>ranks {format_ranks(self.shape.ranks)}</small></div>"
                f"<table>{table}</table></div>")


def _short(text: str) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."


def _coords(p: Point) -> str:
    return ", ".join(f"{k}={v}" for k, v in p.items())


def _label(p: Point) -> str:
    return f"rank {p.rank} ({_coords(p)})" if len(p) else f"rank {p.rank}"


def _grid_text(shape: Shape, cells: list[str]) -> str:
    (rname, rn), (cname, cn) = shape.dims
    headers = [""] + [f"{cname} {j}" for j in range(cn)]
    rows = [[f"{rname} {i}"] + cells[i * cn:(i + 1) * cn] for i in range(rn)]
    return "\n".join(text_table([headers, *rows], indent="  "))
