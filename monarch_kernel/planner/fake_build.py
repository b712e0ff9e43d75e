"""Building a model on fake tensors (nothing allocated), as the estimates and the FLOPs count do.

A build that changes its parameters' dtype or device (`.to(torch.bfloat16)`, `.half()`) swaps each
parameter for a converted one, and `torch.utils.swap_tensors` refuses a tensor that a weak
reference points to. Under FakeTensorMode every fake tensor made from a meta result is entered in
the mode's converter memo (a WeakValueDictionary), so each parameter has one and every layout
failed with "Couldn't swap Embedding.weight". The memo only saves re-converting tensors that are
converted again; during the build, each swap starts from an empty memo, which drops those weak
references and lets the swap proceed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn


@contextlib.contextmanager
def swappable_fakes(fake: Any) -> Iterator[None]:
    """While it is entered, parameter swaps (dtype or device conversions) work on `fake`'s tensors."""
    import torch.utils

    real = torch.utils.swap_tensors

    def swap(first: torch.Tensor, second: torch.Tensor) -> None:
        fake.fake_tensor_converter.meta_converter.tensor_memo.clear()
        real(first, second)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = real


def build_fake(build: Callable[[], nn.Module], fake: Any) -> nn.Module:
    """`build()` inside the active FakeTensorMode `fake` (see the module docstring)."""
    with swappable_fakes(fake):
        return build()
