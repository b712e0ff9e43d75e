"""A model's FLOPs per training step, counted once on fake tensors for the whole global batch,
and each layout's share per rank.

Per module, only the forward is attributed: FlopCounterMode files backward work under whichever modules
are on its stack when autograd runs it, which is not the module that owns it (a Llama's `self_attn`
came out larger than its own parent layer). A module's share of the whole step is its share of the
forward (backward work follows forward work, layer by layer), and no layout's rank ever does less than
the total divided by the ranks that share it.

torch's counter has no formula for the grouped matmul that mixture-of-experts layers use (`_grouped_mm`);
one is registered here: each token's rows meet one expert's weights, 2 x rows x contraction x outputs.

FLOPs grow linearly with the batch (matmuls, convolutions, attention), so a rank of a layout
without pipeline stages does 1/dp of them; tensor parallelism then splits the layers its plan
covers (and the attention between a pair) tp ways, and repeats the rest (embeddings, norms, the
head) on every rank. Pipeline stages count their own FLOPs where they are estimated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from monarch_kernel.planner.batches import Batch, each
from monarch_kernel.planner.batches import forward as forward_of
from monarch_kernel.planner.batchnorm import batch_norms
from monarch_kernel.planner.fake_build import build_fake, lenient_grouped_mm
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.structure import tp_plan


@dataclass
class ModelFlops:
    """Forward and backward FLOPs of one global batch, in all and per module (torch's names)."""

    total: float  # forward and backward
    root: str  # the model's class name, which prefixes the module names
    by_module: dict[str, float] = field(default_factory=dict)  # the forward's, per module
    forward: float = 0.0  # the forward's FLOPs in all
    param_count: int = 0
    dtype_bytes: int = 4  # of the parameters (which FLOP/s figure applies)
    per_rank: dict[str, float] = field(default_factory=dict)  # layout -> one rank's FLOPs (`rank_flops`)
    batch_norms: int = 0  # BatchNorm layers (their statistics need the data-parallel ranks together)
    error: str = ""  # why they could not be counted


def _grouped_mm_flops(a_shape: tuple[int, ...], b_shape: tuple[int, ...], *args: object,
                      out_shape: tuple[int, ...] | None = None, **kwargs: object) -> int:
    """2 x rows x contraction x outputs of a grouped matmul (2-D or 3-D operands, groups by offsets)."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # tokens (M, K) against experts (G, K, N)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 3:  # (G, M, K) x (G, K, N)
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, K_total) x (K_total, N), grouped along K
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    out = 1
    for size in out_shape or ():
        out *= size
    return 2 * out * a_shape[-1]


def _register_grouped_mm() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    target = torch.ops.aten._grouped_mm
    if target.default not in flop_registry and target not in flop_registry:
        register_flop_formula(target)(_grouped_mm_flops)


def count_flops(build: Callable[[], nn.Module], batch: Batch, loss: Callable[..., torch.Tensor],
                layouts: list[Layout] | None = None) -> ModelFlops:
    """Count on a fake copy of the model (nothing of it is allocated), and one rank's share in
    each of `layouts` (those without pipeline stages)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    _register_grouped_mm()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, lenient_grouped_mm():
        model = build_fake(build, fake)
        params = list(model.parameters())
        inputs, targets = each(batch[0], fake.from_tensor), fake.from_tensor(batch[1])
        with FlopCounterMode(display=False) as forward:
            value = loss(forward_of(model, inputs), targets)
        with FlopCounterMode(display=False) as backward:
            value.backward()
    by_module = {name: float(sum(ops.values())) for name, ops in forward.get_flop_counts().items()}
    forward_total = float(forward.get_total_flops())
    counted = ModelFlops(forward_total + float(backward.get_total_flops()), type(model).__name__, by_module,
                         forward_total, sum(p.numel() for p in params), params[0].element_size() if params else 4,
                         batch_norms=len(batch_norms(model)))
    for layout in layouts or []:
        if layout.pp == 1:
            counted.per_rank[layout.text] = rank_flops(counted, model, layout)
    return counted


def rank_flops(flops: ModelFlops, structure: nn.Module, layout: Layout) -> float:
    """One rank's FLOPs per step in a layout without pipeline stages; `structure` is the model
    (a fake copy will do), for its tensor-parallel plan."""
    return _without_recompute(flops, structure, layout) + _recomputed(flops, structure, layout)


def _without_recompute(flops: ModelFlops, structure: nn.Module, layout: Layout) -> float:
    total = flops.total / layout.data_parallel
    if layout.tp == 1:
        return total
    plan = tp_plan(structure, layout.tp)
    root = flops.root
    split = {f"{root}.{path}" for path in plan.colwise + plan.rowwise + plan.experts}
    split |= {f"{root}.{path}" if path else root for path, _ in plan.heads}  # the attention between the pairs
    shared = sum(flops.by_module.get(name, 0.0) for name in split if not _inside(name, split))
    fraction = min(1.0, shared / flops.forward) if flops.forward > 0 else 0.0  # of the whole step's work
    shared = total * fraction
    return max(total - shared + shared / layout.tp, flops.total / (layout.data_parallel * layout.tp))


def _recomputed(flops: ModelFlops, structure: nn.Module, layout: Layout) -> float:
    """The forward FLOPs that activation checkpointing runs again in the backward, on one rank (the checkpointed
    blocks' forward; split by TP like the rest of the blocks, which it mostly is)."""
    if not layout.ac:
        return 0.0
    from monarch_kernel.planner.parallelize import checkpointed_blocks

    again = sum(flops.by_module.get(f"{flops.root}.{path}", 0.0) for path in checkpointed_blocks(structure, layout.ac))
    return again / (layout.data_parallel * layout.tp)


def _inside(name: str, split: set[str]) -> bool:
    """Whether a module lies inside another split module (whose count already holds it)."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in split for i in range(1, len(parts)))
