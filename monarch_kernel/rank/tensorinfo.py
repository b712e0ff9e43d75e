"""On a rank: what a tensor, DTensor or module is, as plain metadata (no data leaves the rank).

The notebook assembles these descriptions into a `core.sharding.TensorLayout`.
"""

from __future__ import annotations

from typing import Any

from monarch_kernel.core.sharding import TensorDescription


def describe(value: Any, rank: int) -> TensorDescription | list[tuple[str, TensorDescription]]:
    """A tensor's description, or a module's as [(parameter name, description), ...]."""
    import torch

    if isinstance(value, torch.nn.Module):
        return [(name, describe_local(p.data if not hasattr(p, "placements") else p, rank))
                for name, p in value.named_parameters()]
    return describe_local(value, rank)


def describe_local(value: Any, rank: int, checksum: bool = True) -> TensorDescription:
    """On a rank: metadata of a DTensor or plain tensor (no data), as plain values (a plain tensor's
    checksum reads its values: `checksum=False` leaves it out)."""
    import torch

    dtensor_type = _dtensor_type()
    if dtensor_type is not None and isinstance(value, dtensor_type):
        value = _any(value)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = value.device_mesh
        local_shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
        return TensorDescription(
            "dtensor", rank, tuple(value.shape), str(value.dtype).removeprefix("torch."), tuple(local_shape),
            tuple(offset), value.to_local().numel() * value.element_size(), str(value.device),
            placements=tuple(_placement(p) for p in value.placements), mesh_shape=tuple(mesh.mesh.shape),
            mesh_dim_names=tuple(mesh.mesh_dim_names or ()), mesh_coord=tuple(mesh.get_coordinate() or ()))
    if isinstance(value, torch.Tensor):
        data = value.detach()
        total = (float(data.double().sum()) if data.numel() and not data.is_complex() else 0.0) if checksum else None
        return TensorDescription("tensor", rank, tuple(value.shape), str(value.dtype).removeprefix("torch."),
                                 tuple(value.shape), (0,) * value.dim(), value.numel() * value.element_size(),
                                 str(value.device), checksum=total)
    raise TypeError(f"expected a torch.Tensor or DTensor, got {type(value).__name__}")


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _placement(p: Any) -> tuple:
    name = type(p).__name__
    if name == "_StridedShard":
        return ("strided_shard", p.dim, None, getattr(p, "split_factor", None))
    if name == "Shard":
        return ("shard", p.dim, None, None)
    if name == "Partial":
        return ("partial", None, str(getattr(p, "reduce_op", "sum")), None)
    return ("replicate", None, None, None)


def _any(value: Any) -> Any:
    """The value, typed loosely (DTensor's attributes are not in torch's stubs)."""
    return value
