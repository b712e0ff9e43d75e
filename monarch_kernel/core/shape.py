"""Mesh shapes: named dimensions over global ranks, slicing, and rank-set text.

A Shape is an ordered set of named dims (e.g. hosts=2, gpus=4) laid row-major over a
list of global ranks. Slicing with an int drops the dim (as in Monarch); a Python
slice or a list keeps it, renumbered from 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.ranksets import format_ranks

Selector = int | slice | Sequence[int]


@dataclass(frozen=True)
class Point(Mapping[str, int]):
    """A position in a Shape: its coordinates by dim name, and its global rank.

    `dims` are the shape's dims (name, size), so that `point.extent` tells the size of
    the mesh the point is in (what Monarch's `current_size()` reads), as Monarch's `Extent`.
    """

    coords: tuple[tuple[str, int], ...]
    rank: int
    dims: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def extent(self) -> Extent:
        """The sizes of the mesh this point is in."""
        return Extent([name for name, _ in self.dims], [size for _, size in self.dims])

    def __getitem__(self, dim: str) -> int:
        for name, value in self.coords:
            if name == dim:
                return value
        raise KeyError(dim)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.coords)

    def __len__(self) -> int:
        return len(self.coords)

    def __hash__(self) -> int:
        return hash((self.coords, self.rank))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.coords)
        return f"Point({inner}, rank={self.rank})"

    def __str__(self) -> str:
        """Monarch's form: each coordinate over its dim's size, e.g. {'hosts': 0/1, 'gpus': 1/2}."""
        sizes = dict(self.dims)
        return "{" + ", ".join(f"{k!r}: {v}/{sizes[k]}" if k in sizes else f"{k!r}: {v}" for k, v in self.coords) + "}"


class Extent(Mapping[str, int]):
    """Dim sizes by name, as Monarch's `Extent`: a mapping (equal to a dict of the same sizes, as ours always was)
    with `labels`, `sizes` and `nelements`, printed as Monarch prints it: `{hosts: 2, gpus: 4}`."""

    __slots__ = ("_dims",)

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]) -> None:
        labels, sizes = list(labels), list(sizes)
        if len(labels) != len(sizes):
            raise ValueError(f"Extent: {len(labels)} labels but {len(sizes)} sizes")
        self._dims = dict(zip(labels, sizes))
        if len(self._dims) != len(labels):
            raise ValueError(f"Extent: labels {labels} repeat a name")

    @property
    def labels(self) -> list[str]:
        """The dim names, in order."""
        return list(self._dims)

    @property
    def sizes(self) -> list[int]:
        """The dim sizes, in the labels' order."""
        return list(self._dims.values())

    @property
    def nelements(self) -> int:
        """How many points."""
        total = 1
        for size in self._dims.values():
            total *= size
        return total

    def __getitem__(self, label: str) -> int:
        return self._dims[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):  # (order counts between extents, as in Monarch)
            return list(self._dims.items()) == list(other._dims.items())
        return isinstance(other, Mapping) and dict(self._dims) == dict(other)

    __hash__ = None  # type: ignore[assignment]  # (a mapping, equal to dicts: unhashable as they are)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self._dims.items()) + "}"

    def __reduce__(self) -> tuple[type, tuple[list[str], list[int]]]:
        return Extent, (self.labels, self.sizes)


@dataclass(frozen=True)
class Shape:
    """Named dims (in order) with sizes, over the given global ranks (row-major)."""

    dims: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        size = 1
        for _, n in self.dims:
            size *= n
        if size != len(self.ranks):
            raise ValueError(f"shape {self.dims} holds {size} points, got {len(self.ranks)} ranks")

    @classmethod
    def grid(cls, **sizes: int) -> Shape:
        """A full shape over ranks 0..N-1, e.g. Shape.grid(hosts=2, gpus=4)."""
        total = 1
        for n in sizes.values():
            total *= n
        return cls(tuple(sizes.items()), tuple(range(total)))

    @property
    def names(self) -> tuple[str, ...]:
        """Dim names in order."""
        return tuple(name for name, _ in self.dims)

    @property
    def sizes(self) -> dict[str, int]:
        """Dim sizes by name, e.g. {'hosts': 1, 'gpus': 4}."""
        return dict(self.dims)

    def __len__(self) -> int:
        return len(self.ranks)

    def points(self) -> Iterator[Point]:
        """Every point, row-major."""
        ranges = [range(n) for _, n in self.dims]
        for idx, coords in enumerate(itertools.product(*ranges)):
            yield Point(tuple(zip(self.names, coords)), self.ranks[idx], self.dims)

    def numbered_point(self, rank: int) -> Point | None:
        """Where a global rank is in this shape, numbered within it (its `.rank` is its row-major index here,
        as Monarch's current_rank() counts in a slice); None if the rank is not in this shape."""
        if rank not in self.ranks:
            return None
        index = self.ranks.index(rank)
        point = next(itertools.islice(self.points(), index, None))
        return Point(point.coords, index, self.dims)

    def index_of(self, **coords: int) -> int:
        """Row-major position of the point with these coordinates (all dims required)."""
        missing = [n for n in self.names if n not in coords]
        extra = [k for k in coords if k not in self.names]
        if missing or extra:
            raise MeshUsageError(
                f"coordinates {coords} do not match dims {self.names}: give exactly one "
                f"integer per dim, e.g. {', '.join(f'{n}=0' for n in self.names)}"
            )
        pos = 0
        for name, size in self.dims:
            value = coords[name]
            if not 0 <= value < size:
                raise MeshUsageError(f"{name}={value} is out of range: {name} has size {size}")
            pos = pos * size + value
        return pos

    def slice(self, **selectors: Selector | None) -> Shape:
        """Select along named dims: an int drops the dim, a slice or list keeps it."""
        for name in selectors:
            if name not in self.names:
                raise MeshUsageError(f"no dim named {name!r}; this mesh has dims {self.names}")
        per_dim: list[list[int]] = []
        keep: list[bool] = []
        for name, size in self.dims:
            sel = selectors.get(name)
            indices, kept = _select(name, size, sel)
            per_dim.append(indices)
            keep.append(kept)
        strides = _strides([n for _, n in self.dims])
        ranks = tuple(
            self.ranks[sum(i * s for i, s in zip(combo, strides))]
            for combo in itertools.product(*per_dim)
        )
        dims = tuple(
            (name, len(idx)) for (name, _), idx, kept in zip(self.dims, per_dim, keep) if kept
        )
        return Shape(dims, ranks)

    def select_ranks(self, ranks: Sequence[int]) -> Shape:
        """A 1-D shape {ranks: n} over the given global ranks (each must be in this shape)."""
        unknown = [r for r in ranks if r not in self.ranks]
        if unknown:
            raise MeshUsageError(f"ranks {unknown} are not in this mesh (ranks {format_ranks(self.ranks)})")
        return Shape((("ranks", len(ranks)),), tuple(ranks))

    def flatten(self, name: str) -> Shape:
        """All dims folded into one named `name`, in row-major order: {hosts: 2, gpus: 4} -> {name: 8}."""
        _check_dim_name(name)
        return Shape(((name, len(self.ranks)),), self.ranks)

    def rename(self, **names: str) -> Shape:
        """The same points with dims renamed: `shape.rename(gpus="tp")`."""
        for old, new in names.items():
            if old not in self.names:
                raise MeshUsageError(f"no dim named {old!r} to rename; this mesh has dims {self.names}")
            _check_dim_name(new)
        dims = tuple((names.get(n, n), size) for n, size in self.dims)
        _check_unique([n for n, _ in dims])
        return Shape(dims, self.ranks)

    def split(self, **spec: Sequence[str] | int) -> Shape:
        """Split dims into several, row-major: `split(hosts=("dp", "pp"), pp=2)` turns {hosts: 4} into
        {dp: 2, pp: 2}. A new dim's size is given by name (`pp=2`); at most one per split may be left out."""
        splits: dict[str, tuple[str, ...]] = {}
        sizes: dict[str, int] = {}
        for key, value in spec.items():
            if key in self.names:
                if isinstance(value, (str, int)) or not all(isinstance(p, str) for p in value):
                    raise MeshUsageError(f"split({key}=...): give the new dims' names as a tuple, "
                                         f"e.g. {key}=('dp', 'pp')")
                splits[key] = tuple(value)
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                sizes[key] = value
            else:
                raise MeshUsageError(f"split(): {key!r} is not a dim of {self.names}, so it must be the positive "
                                     f"size of a new dim (got {value!r})")
        dims: list[tuple[str, int]] = []
        for name, size in self.dims:
            parts = splits.get(name, (name,))
            unknown = [p for p in parts if p not in sizes]
            given = 1
            for p in parts:
                given *= sizes.get(p, 1)
            if len(unknown) > 1:
                raise MeshUsageError(f"cannot split {name} ({size}) into {parts}: give the size of all but "
                                     f"one, e.g. {unknown[1]}=2")
            if unknown:
                if size % given:
                    raise MeshUsageError(f"{name} has size {size}, which {parts} with sizes "
                                         f"{[sizes.get(p, '?') for p in parts]} do not divide")
                sizes[unknown[0]] = size // given
            elif given != size:
                raise MeshUsageError(f"{name} has size {size}, but {parts} have sizes "
                                     f"{[sizes[p] for p in parts]} (product {given})")
            dims.extend((p, sizes.pop(p)) for p in parts)
        if sizes:
            raise MeshUsageError(f"split(): sizes given for dims that no split names: {sorted(sizes)}")
        _check_unique([n for n, _ in dims])
        return Shape(tuple(dims), self.ranks)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.dims) + "}"


class MeshShaped:
    """Shape operations shared by mesh-like handles (actor, process, host and value meshes).

    A subclass has a `shape` and makes the same kind of handle over other points with `_with`.
    """

    shape: Shape

    def _with(self, shape: Shape) -> Self:
        """The same kind of handle over `shape`'s points: every subclass defines it (the mixin cannot)."""
        raise NotImplementedError

    def slice(self, **selectors: Selector | None) -> Self:
        """A slice: an int drops the dim, a slice or list keeps it (`mesh.slice(hosts=0, gpus=slice(0, 2))`)."""
        return self._with(self.shape.slice(**selectors))

    def flatten(self, name: str) -> Self:
        """The same points along one dim named `name`."""
        return self._with(self.shape.flatten(name))

    def rename(self, **names: str) -> Self:
        """The same points with dims renamed: `mesh.rename(gpus="tp")`."""
        return self._with(self.shape.rename(**names))

    def split(self, **spec: Sequence[str] | int) -> Self:
        """The same points with dims split: `mesh.split(hosts=("dp", "pp"), pp=2)`."""
        return self._with(self.shape.split(**spec))

    def size(self, dim: str | None = None) -> int:
        """How many points (along `dim`, or in all)."""
        return len(self.shape) if dim is None else self.shape.sizes[dim]

    @property
    def sizes(self) -> dict[str, int]:
        """Dim sizes by name, e.g. {'hosts': 2, 'gpus': 4} ({} for a single point)."""
        return self.shape.sizes

    @property
    def extent(self) -> Extent:
        """The dim sizes as Monarch's `Extent` (a mapping, equal to `sizes`, with `labels` and `sizes` lists)."""
        sizes = self.shape.sizes
        return Extent(list(sizes), list(sizes.values()))

    def __len__(self) -> int:
        return len(self.shape)


def _check_dim_name(name: object) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise MeshUsageError(f"dim name {name!r}: use an identifier, e.g. 'gpus' or 'dp'")


def _check_unique(names: list[str]) -> None:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise MeshUsageError(f"dim names must differ; {repeated} would appear twice")


def _strides(sizes: list[int]) -> list[int]:
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    return strides


def _select(name: str, size: int, sel: Selector | None) -> tuple[list[int], bool]:
    if sel is None:
        return list(range(size)), True
    if isinstance(sel, bool):
        raise MeshUsageError(f"{name}={sel!r}: expected an int, a slice or a list of ints")
    if isinstance(sel, int):
        if not -size <= sel < size:
            raise MeshUsageError(f"{name}={sel} is out of range: {name} has size {size} (0..{size - 1})")
        return [sel % size], False
    if isinstance(sel, slice):
        indices = list(range(size))[sel]
        if not indices:
            raise MeshUsageError(f"{name}={_slice_text(sel)} selects nothing: {name} has size {size}")
        return indices, True
    indices = list(sel)
    for i in indices:
        if not isinstance(i, int) or not 0 <= i < size:
            raise MeshUsageError(f"{name}={indices}: {i!r} is out of range: {name} has size {size}")
    if not indices:
        raise MeshUsageError(f"{name}=[] selects nothing")
    return indices, True


def _slice_text(s: slice) -> str:
    parts = ["" if v is None else str(v) for v in (s.start, s.stop, s.step)]
    return ":".join(parts[:2]) + (f":{parts[2]}" if s.step is not None else "")


def parse_spec(text: str) -> int | slice | list[int]:
    """Parse a selector as typed in a magic: `2`, `0,2`, `0:4`, `::2`."""
    text = text.strip()
    try:
        if ":" in text:
            parts = text.split(":")
            if len(parts) > 3:
                raise ValueError
            nums = [int(p) if p.strip() else None for p in parts]
            return slice(*nums)
        if "," in text:
            return [int(p) for p in text.split(",") if p.strip()]
        return int(text)
    except ValueError:
        raise MeshUsageError(
            f"bad selector {text!r}: use an int (2), a list (0,2) or a slice (0:4, ::2)"
        ) from None
