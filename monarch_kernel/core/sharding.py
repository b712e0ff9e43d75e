"""How a tensor is laid out over the mesh: a model built from metadata only.

Each rank describes its own piece (`rank.tensorinfo.describe_local`: global shape,
placements, device mesh, local shape and offset; for a plain tensor its shape and a
checksum). The controller assembles the pieces into a `TensorLayout` and cuts the two
drawn dims into blocks (`blocks`), which every view (text, HTML, widget) draws the same
way. No tensor data ever leaves a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """One DTensor placement: shard (dim), replicate, partial (reduce op), strided_shard."""

    kind: str
    dim: int | None = None
    reduce_op: str | None = None
    split_factor: int | None = None

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "strided_shard":
            return f"StridedShard({self.dim}, split_factor={self.split_factor})"
        if self.kind == "partial":
            return f"Partial({self.reduce_op})"
        return "Replicate()"


@dataclass(frozen=True)
class LocalPiece:
    """What one rank holds of a tensor."""

    rank: int
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    nbytes: int
    device: str
    dtype: str
    mesh_coord: tuple[int, ...] | None = None  # coordinates in the DeviceMesh (DTensor only)
    checksum: float | None = None  # plain tensors: to tell whether ranks hold the same values


@dataclass(frozen=True)
class TensorLayout:
    """A tensor over the mesh: a DTensor (placements on a DeviceMesh) or a per-rank plain tensor."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[LocalPiece, ...]
    placements: tuple[Placement, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = ()
    labels: dict[int, str] = field(default_factory=dict)  # rank -> "host:gpu (rank r)"

    @property
    def is_dtensor(self) -> bool:
        """Whether this is a DTensor (else one plain tensor per rank)."""
        return bool(self.placements)

    @property
    def partial(self) -> tuple[Placement, ...]:
        """Placements that leave values unreduced."""
        return tuple(p for p in self.placements if p.kind == "partial")

    def extent(self, piece: LocalPiece, dim: int) -> tuple[int, int]:
        """[start, stop) of a piece along a tensor dim."""
        return piece.offset[dim], piece.offset[dim] + piece.local_shape[dim]

    def empty_pieces(self) -> list[LocalPiece]:
        """Ranks that hold no elements (uneven sharding: 5 rows over 4 ranks gives 2, 2, 1, 0)."""
        return [p for p in self.pieces if any(n == 0 for n in p.local_shape)]

    def blocks(self, row_dim: int | None, col_dim: int | None,
               at: dict[int, tuple[int, int]] | None = None) -> list[list[Block]]:
        """Cut the drawn dims at every shard boundary; each block lists the ranks holding it.

        `at` picks a range on each dim that is not drawn (a facet, see facets()).
        """
        fixed = {d: r[0] for d, r in (at or {}).items()}
        rows = self._cuts(row_dim)
        cols = self._cuts(col_dim)
        grid = []
        for r0, r1 in rows:
            line = []
            for c0, c1 in cols:
                holders = []
                for piece in self.pieces:
                    if any(n == 0 for n in piece.local_shape):
                        continue
                    if row_dim is not None and not _covers(self.extent(piece, row_dim), r0, r1):
                        continue
                    if col_dim is not None and not _covers(self.extent(piece, col_dim), c0, c1):
                        continue
                    if not all(_covers(self.extent(piece, d), x, x + 1) for d, x in fixed.items()):
                        continue
                    holders.append(piece.rank)
                line.append(Block((r0, r1), (c0, c1), tuple(sorted(holders))))
            grid.append(line)
        return grid

    def facets(self, row_dim: int | None, col_dim: int | None) -> list[dict[int, tuple[int, int]]]:
        """One choice of range per shard boundary on each dim that is not drawn."""
        choices: list[dict[int, tuple[int, int]]] = [{}]
        for d in range(len(self.global_shape)):
            if d not in (row_dim, col_dim):
                choices = [{**c, d: r} for c in choices for r in self._cuts(d)]
        return choices

    def _cuts(self, dim: int | None) -> list[tuple[int, int]]:
        if dim is None:
            return [(0, 1)]
        size = self.global_shape[dim]
        points = {0, size}
        for piece in self.pieces:
            start, stop = self.extent(piece, dim)
            if stop > start:
                points.update((start, stop))
        ordered = sorted(p for p in points if 0 <= p <= size)
        return [(a, b) for a, b in zip(ordered, ordered[1:]) if b > a] or [(0, size)]


@dataclass(frozen=True)
class Block:
    """A rectangle of the drawn dims and the ranks that hold it (several when replicated)."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    ranks: tuple[int, ...]


def _covers(extent: tuple[int, int], start: int, stop: int) -> bool:
    return extent[0] <= start and stop <= extent[1]


@dataclass(frozen=True)
class TensorDescription:
    """What a rank says of one tensor or DTensor, without its data (the answer to `wire.ops.Describe`).

    kind: "tensor" (a plain tensor; `checksum` is the sum of its values) or "dtensor" (then `placements`
    as `Placement`'s fields, the device mesh's shape and dim names, and this rank's coordinate in it)."""

    kind: str
    rank: int
    global_shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    nbytes: int
    device: str
    checksum: float | None = None
    placements: tuple[tuple[str, int | None, str | None, int | None], ...] = ()
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = ()
    mesh_coord: tuple[int, ...] | None = None

    def summary(self) -> str:
        """One line for a person: `float32[8, 4] on cuda:0`, and for a DTensor its local piece and placements."""
        line = f"{self.dtype}[{', '.join(map(str, self.global_shape))}] on {self.device}"
        if self.kind != "dtensor":
            return line
        placements = ", ".join(str(Placement(*p)) for p in self.placements)
        names = f" ({', '.join(self.mesh_dim_names)})" if self.mesh_dim_names else ""
        return (f"{line}, this rank's piece [{', '.join(map(str, self.local_shape))}] at "
                f"({', '.join(map(str, self.offset))}); {placements} over mesh "
                f"{'x'.join(map(str, self.mesh_shape))}{names}")


def layout_from(name: str, described: list[TensorDescription], labels: dict[int, str]) -> TensorLayout:
    """Assemble the ranks' descriptions (`rank.tensorinfo.describe_local`) into one layout."""
    if not described:
        raise ValueError("no rank described the tensor")
    first = described[0]
    pieces = tuple(LocalPiece(d.rank, d.local_shape, d.offset, d.nbytes, d.device, d.dtype, d.mesh_coord, d.checksum)
                   for d in sorted(described, key=lambda d: d.rank))
    if first.kind == "dtensor":
        return TensorLayout(name, first.global_shape, first.dtype, pieces,
                            tuple(Placement(*p) for p in first.placements), first.mesh_shape,
                            first.mesh_dim_names, labels)
    return TensorLayout(name, first.global_shape, first.dtype, pieces, labels=labels)
