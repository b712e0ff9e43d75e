"""A training batch as models take it: `(inputs, targets)`, where inputs is one tensor (`model(inputs)`) or, as
Hugging Face models take them, a dict of tensors (`model(**inputs)`: input_ids, attention_mask, ...).

Every tensor of a batch shares its first dimension (the samples): a data-parallel share slices each of them
alike, and moving or faking a batch does each tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

Inputs = torch.Tensor | Mapping[str, torch.Tensor]
Batch = tuple[Inputs, torch.Tensor]


def forward(model: Callable[..., Any], inputs: Inputs) -> Any:
    """The model's output for these inputs (keyword arguments for a dict)."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def each(inputs: Inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """fn applied to every tensor of the inputs (the same kind back)."""
    if isinstance(inputs, Mapping):
        return {key: fn(value) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    return fn(inputs)


def batch_size(inputs: Inputs) -> int:
    """How many samples the inputs hold (their tensors' first dimension; ValueError if they disagree)."""
    if not isinstance(inputs, Mapping):
        return int(inputs.shape[0])
    sizes = {key: int(value.shape[0]) for key, value in inputs.items() if isinstance(value, torch.Tensor)}
    if not sizes:
        raise ValueError("the batch's inputs hold no tensor: give a tensor, or a dict of tensors (model(**inputs))")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the batch's input tensors disagree on the number of samples (first dimension): {sizes}")
    return next(iter(sizes.values()))


def check_batch(batch: Any) -> Batch:
    """The batch if it is `(inputs, targets)` as the planner takes it; ValueError saying what to give otherwise."""
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise ValueError("batch() must return (inputs, targets): inputs a tensor or a dict of tensors "
                         f"(model(**inputs)), targets a tensor; it returned {type(batch).__name__}")
    inputs, targets = batch
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"the batch's targets must be a tensor, not {type(targets).__name__}")
    if not isinstance(inputs, torch.Tensor | Mapping):
        raise ValueError(f"the batch's inputs must be a tensor or a dict of tensors, not {type(inputs).__name__}")
    if batch_size(inputs) != int(targets.shape[0]):
        raise ValueError(f"the batch's inputs hold {batch_size(inputs)} samples and its targets "
                         f"{int(targets.shape[0])}: they must agree")
    return inputs, targets


def without_cache(model: torch.nn.Module) -> str:
    """Turn a Hugging Face model's key/value cache off for training (it returns the cache otherwise, which
    pipelines cannot trace and training never uses); a note for the user when it was on, else ""."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
        return f"{type(model).__name__}: its key/value cache was turned off for training (config.use_cache=False)"
    return ""
