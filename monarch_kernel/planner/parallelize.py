"""Putting a built model into a layout on the ranks' process group, and the training step of it.

The same code runs for real on a mesh's ranks and, on fake tensors with a fake process group,
when a layout is estimated: what is estimated is what is applied.

- DDP alone: torch's DistributedDataParallel, its buckets holding the gradients (`gradient_as_bucket_view`).
- FSDP: `fully_shard` on each repeated block, then on the whole model.
- TP: `parallelize_module` with the plan `structure.tp_plan` finds; the head counts of split
  attention modules are divided by the degree; embedding tables split by rows (Embedding) or
  columns (EmbeddingBag); mixtures of experts split by experts.
- DDP with TP: the tensor-parallel model, its gradients averaged over the data-parallel ranks
  after each backward (DistributedDataParallel does not take DTensor parameters).
- ac=K: every K-th block recomputes its activations in the backward (after TP, before FSDP).
- BatchNorm layers, with data parallelism: their statistics over the data-parallel ranks (`batchnorm.py`).
- mp=bf16: FSDP's `MixedPrecisionPolicy` (bf16 parameters in compute, fp32 sharded master weights,
  gradients reduced in fp32, the model's outputs in fp32 for the loss); without FSDP, the forward
  and the loss under `torch.autocast` in bf16 (fp32 weights, gradients and reduction).
- PP: this rank's pipeline stage (`pipeline.py`), with FSDP on its blocks, or its gradients
  averaged by hand over the data-parallel ranks (DDP's per-backward reduction does not fit a
  schedule that runs a backward per micro-batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from monarch_kernel.planner.batches import Batch, Inputs, batch_size, each, forward
from monarch_kernel.planner.batchnorm import batch_norms, synchronize_batch_norms
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.pipeline import PipelineStage, TracedPipeline, pipeline_step, take_stage, trace_pipeline
from monarch_kernel.planner.structure import blocks, is_conv1d, tp_plan

Placed = nn.Module | PipelineStage  # what a layout makes of the model on one rank


def device_mesh(layout: Layout, device_type: str) -> Any:
    """The DeviceMesh of a layout over the default process group: dims ("pp", "dp", "tp") as used."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = [], []
    if layout.pp > 1:
        shape.append(layout.pp)
        names.append("pp")
    if layout.data_parallel > 1 or (layout.tp == 1 and layout.pp == 1):
        shape.append(layout.data_parallel)
        names.append("dp")
    if layout.tp > 1:
        shape.append(layout.tp)
        names.append("tp")
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def precision_policy(layout: Layout, root: bool) -> Any:
    """FSDP's MixedPrecisionPolicy for a layout: bf16 compute, fp32 reduction, and (root) fp32 outputs
    for `mp=bf16`; the default (compute in the parameters' dtype) otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not layout.mp:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def autocast(layout: Layout, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """What the forward and the loss run under: bf16 autocast for a mixed-precision layout without FSDP
    (FSDP casts its parameters itself), nothing otherwise."""
    if layout.mp and layout.fsdp == 1:
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fully_shard_blocks(module: nn.Module, block_paths: list[str], mesh: Any, layout: Layout) -> None:
    """FSDP over the data-parallel dimension: each block its own unit, then the rest (in the layout's precision)."""
    from torch.distributed.fsdp import fully_shard

    for path in block_paths:
        fully_shard(module.get_submodule(path), mesh=mesh["dp"], mp_policy=precision_policy(layout, root=False))
    fully_shard(module, mesh=mesh["dp"], mp_policy=precision_policy(layout, root=True))


def place(model: nn.Module | TracedPipeline, layout: Layout, mesh: Any, device: torch.device,
          loss_fn: Callable[..., torch.Tensor], local_inputs: torch.Tensor | None = None) -> Placed:
    """The model in `layout` on this rank: the parallelized module, or (PP) its pipeline stage,
    traced on `local_inputs` (this rank's data-parallel share of a global batch's inputs) unless
    given traced already."""
    if layout.pp == 1:
        assert isinstance(model, nn.Module)
        return parallelize(model, layout, mesh)
    if isinstance(model, nn.Module):
        if local_inputs is None:
            raise ValueError("a pipeline layout is traced on a batch: give the global batch")
        model = trace_pipeline(model, layout.pp, local_inputs, device)

    def shard(module: nn.Module, held: list[str]) -> None:
        if layout.fsdp > 1:
            fully_shard_blocks(module, held, mesh, layout)

    return take_stage(model, mesh, device, loss_fn, shard)


def module_of(placed: Placed) -> nn.Module:
    """The module whose parameters this rank trains (a pipeline's stage module)."""
    return placed.module if isinstance(placed, PipelineStage) else placed


def synchronized(model: nn.Module, layout: Layout, mesh: Any) -> nn.Module:
    """The model with its BatchNorms' statistics taken over the data-parallel ranks (if it has any, and them)."""
    if layout.data_parallel > 1 and batch_norms(model):
        return synchronize_batch_norms(model, mesh["dp"].get_group(), mesh.device_type)
    return model


def parallelize(model: nn.Module, layout: Layout, mesh: Any) -> nn.Module:
    """The model in a layout without pipeline stages (modified in place; DDP alone returns its wrapper)."""
    model = synchronized(model, layout, mesh)
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = tp_plan(model, layout.tp)
        if not plan.applicable:
            raise ValueError(f"tensor parallelism does not apply to this model: {plan.reason}")
        from monarch_kernel.planner.tp_styles import Conv1DColwise, Conv1DRowwise, EmbeddingBagColwise, ExpertsSharded

        def style(path: str, linear: type, conv1d: type) -> Any:
            return conv1d() if is_conv1d(model.get_submodule(path)) else linear()

        styles: dict[str, Any] = {path: style(path, ColwiseParallel, Conv1DColwise) for path in plan.colwise}
        styles.update({path: style(path, RowwiseParallel, Conv1DRowwise) for path in plan.rowwise})
        from torch.distributed.tensor import Replicate

        styles.update({path: EmbeddingBagColwise() if isinstance(model.get_submodule(path), nn.EmbeddingBag)
                       else RowwiseParallel(input_layouts=Replicate()) for path in plan.embeddings})  # (ids whole)
        styles.update({path: ExpertsSharded() for path in plan.experts})
        parallelize_module(model, mesh["tp"], styles)
        for path, attr in plan.heads:
            owner = model.get_submodule(path) if path else model
            setattr(owner, attr, getattr(owner, attr) // layout.tp)
    if layout.ac:
        checkpoint_blocks(model, layout.ac)
    if layout.fsdp > 1:
        fully_shard_blocks(model, [path for path, _ in blocks(model)], mesh, layout)
    elif layout.ddp > 1 and layout.tp == 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, gradient_as_bucket_view=True)  # its buckets hold the gradients
    return model


def checkpointed_blocks(model: nn.Module, every: int) -> list[str]:
    """The paths of the blocks that `ac=every` recomputes (every `every`-th, from the first)."""
    return [path for index, (path, _) in enumerate(blocks(model)) if index % every == 0]


def checkpoint_blocks(model: nn.Module, every: int) -> None:
    """Activation checkpointing on every `every`-th block: its activations are dropped after the forward and
    recomputed in the backward (torch's composable `checkpoint`: module paths and parameter names stay)."""
    from torch.distributed._composable import checkpoint

    for path in checkpointed_blocks(model, every):
        checkpoint(model.get_submodule(path))


def make_optimizer(optimizer: str | Callable[..., torch.optim.Optimizer], params: Any,
                   lr: float | None) -> torch.optim.Optimizer:
    """"adamw" (torch's AdamW, its defaults, lr 1e-3 unless given), "adam", "sgd", or a callable(params, lr=...).

    The named ones get the DTensor parameters (tensor parallelism's) and the plain ones in separate groups:
    on GPUs torch steps each group with multi-tensor kernels, which refuse a mix of the two."""
    if callable(optimizer):
        return optimizer(params) if lr is None else optimizer(params, lr=lr)
    rate = 1e-3 if lr is None else lr
    kinds: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    if optimizer not in kinds:
        raise ValueError(f"optimizer {optimizer!r}: use one of {sorted(kinds)} or a callable(params, lr=...)")
    return kinds[optimizer](_alike_groups(list(params)), lr=rate)


def _alike_groups(params: list[Any]) -> list[Any]:
    """The parameters as given, or in two groups (DTensors, plain tensors) when they mix both."""
    if not params or isinstance(params[0], dict):  # (param groups of the caller's own)
        return params
    distributed = [p for p in params if hasattr(p, "to_local")]
    if not distributed or len(distributed) == len(params):
        return params
    return [{"params": distributed}, {"params": [p for p in params if not hasattr(p, "to_local")]}]


def data_parallel_rank(layout: Layout, mesh: Any) -> tuple[int, Any]:
    """This rank's index among the data-parallel ranks, and their process group (None if alone)."""
    if layout.data_parallel == 1:
        return 0, None
    return mesh["dp"].get_local_rank(), mesh["dp"].get_group()


def data_share(batch: Batch, parts: int, dp_rank: int) -> Batch:
    """The slice of a global batch one of `parts` data-parallel ranks takes (ValueError if it does not divide)."""
    inputs, targets = batch
    size = batch_size(inputs)
    if size % parts:
        raise ValueError(f"a global batch of {size} does not split over {parts} data-parallel ranks")
    share = slice(dp_rank * size // parts, (dp_rank + 1) * size // parts)
    return each(inputs, lambda t: t[share]), targets[share]


def make_local_step(placed: Placed, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                    layout: Layout, mesh: Any) -> Callable[[Inputs, torch.Tensor], torch.Tensor | None]:
    """step(inputs, targets) on this rank's share: forward, backward (the pipeline's schedule for
    PP), gradients averaged by hand where DDP cannot, the optimizer's step; returns the share's
    loss (None on a pipeline stage that is not the last)."""
    _, dp_group = data_parallel_rank(layout, mesh)
    module = module_of(placed)
    average_by_hand = layout.ddp > 1 and (layout.tp > 1 or layout.pp > 1)

    def step(x: Inputs, y: torch.Tensor) -> torch.Tensor | None:
        optimizer.zero_grad(set_to_none=True)
        if isinstance(placed, PipelineStage):
            if not isinstance(x, torch.Tensor):
                raise ValueError("a pipeline takes one input tensor per micro-batch, not a dict of inputs")
            loss = pipeline_step(placed, x, y)
        else:
            with autocast(layout, mesh.device_type):
                loss = loss_fn(forward(placed, x), y)
            loss.backward()
        if average_by_hand:
            average_gradients(module, dp_group, layout.data_parallel)
        optimizer.step()
        return loss

    return step


def make_train_step(placed: Placed, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                    layout: Layout, mesh: Any, device: torch.device) -> Callable[[Batch], float]:
    """train_step(global batch) -> the global batch's mean loss, on every rank.

    The batch is split over the data-parallel ranks (the ranks of one tensor-parallel group, and
    the stages of one pipeline, take the same slice); forward, backward and the optimizer step
    follow.
    """
    dp_rank, dp_group = data_parallel_rank(layout, mesh)
    parts = layout.data_parallel
    local_step = make_local_step(placed, optimizer, loss_fn, layout, mesh)

    def train_step(batch: Batch) -> float:
        inputs, targets = data_share(batch, parts, dp_rank)
        loss = local_step(each(inputs, lambda t: t.to(device)), targets.to(device))
        if layout.pp > 1:  # only the last stages hold a loss: sum theirs over every rank
            value = torch.zeros((), device=device) if loss is None else loss.float().clone()
            dist.all_reduce(value)
            return float(value) / parts
        assert loss is not None
        value = loss.detach().float().clone()
        if dp_group is not None:
            dist.all_reduce(value, group=dp_group)
            value /= parts
        return float(value)

    return train_step


def average_gradients(model: nn.Module, group: Any, parts: int) -> None:
    """Average every gradient over the data-parallel group (their local shards, for DTensors)."""
    for param in model.parameters():
        if param.grad is None:
            continue
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=group)
        local /= parts
