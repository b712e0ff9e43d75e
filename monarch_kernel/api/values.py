"""Values on their way to and from the ranks: what a push seals, where a pull may put tensors."""

from __future__ import annotations

from typing import Any

from monarch_kernel.core.errors import MeshUsageError, SerializationError
from monarch_kernel.wire.serialization import Sealed, seal


def check_device(device: str) -> None:
    """A device this process can put pulled tensors on (else MeshUsageError saying why)."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as exc:
        raise MeshUsageError(f"pull(device={device!r}): not a torch device ({exc}); e.g. 'cpu' or 'cuda:0'") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise MeshUsageError(f"pull(device={device!r}): the notebook's process has no CUDA device; pull to the "
                             "CPU (the default) and move the values where they can go")


def seal_named(values: dict[str, Any], shm_dir: str | None) -> Sealed:
    """Seal values a push sends (a value that cannot be pickled is named in the error)."""
    try:
        return seal(values, shm_dir=shm_dir, shared=True)
    except SerializationError:
        for key, value in values.items():  # find which variable is the problem
            seal(value, name=key)
        raise
