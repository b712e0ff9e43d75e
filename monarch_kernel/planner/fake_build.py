"""Building a model on fake tensors (nothing allocated), as the estimates and the FLOPs count do.

A build that changes its parameters' dtype or device (`.to(torch.bfloat16)`, `.half()`) swaps each
parameter for a converted one, and `torch.utils.swap_tensors` refuses a tensor that a weak
reference points to. Under FakeTensorMode every fake tensor made from a meta result is entered in
the mode's converter memo (a WeakValueDictionary), so each parameter has one and every layout
failed with "Couldn't swap Embedding.weight". The memo only saves re-converting tensors that are
converted again; during the build, each swap starts from an empty memo, which drops those weak
references and lets the swap proceed.

Mixture-of-experts layers in transformers run their experts through torch's grouped matmul
(`_grouped_mm`), whose fake kernel mirrors the CUDA one and takes bf16 only, where the CPU kernel takes
fp32 too: for CPU ranks `lenient_grouped_mm` lets the fake kernel take what the CPU takes (its shapes
and its output dtype are those of the inputs). Counting FLOPs uses it whatever the ranks: a count does
not depend on the dtype.
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


@contextlib.contextmanager
def lenient_grouped_mm() -> Iterator[None]:
    """While it is entered, the fake `_grouped_mm` takes fp32 and fp16 inputs (see the module docstring)."""
    import torch._meta_registrations as meta

    real = meta._meta_grouped_mm_common

    def common(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: Any, scale_b: Any, offs: Any = None,
               bias: Any = None, scale_result: Any = None, out_dtype: Any = None, use_fast_accum: bool = False) -> Any:
        dtype = mat_a.dtype
        if scale_a is None and mat_b.dtype == dtype and dtype in (torch.float32, torch.float16) \
                and out_dtype in (None, dtype):
            return real(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), scale_a, scale_b, offs,
                        None if bias is None else bias.to(torch.bfloat16), scale_result, None, use_fast_accum).to(dtype)
        return real(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)

    meta._meta_grouped_mm_common = common
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = real


def build_fake(build: Callable[[], nn.Module], fake: Any) -> nn.Module:
    """`build()` inside the active FakeTensorMode `fake` (see the module docstring)."""
    with swappable_fakes(fake):
        return build()
