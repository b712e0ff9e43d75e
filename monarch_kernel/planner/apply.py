"""On a rank: build the model as `torch.manual_seed(seed); build()` gives it in one process, put it
in a layout, and make its optimizer and training step (what `Plan.apply` binds on every rank)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from monarch_kernel.planner.batches import Batch, forward, without_cache
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.parallelize import (
    data_share,
    device_mesh,
    make_optimizer,
    make_train_step,
    module_of,
    place,
)


@dataclass(frozen=True)
class TrainingSpec:
    """What to build and how to train it (the same for every layout)."""

    build: Callable[[], nn.Module]
    loss: Callable[..., torch.Tensor]
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw"
    lr: float | None = None
    seed: int = 0

    def make(self) -> nn.Module:
        """The model, ready for training (a Hugging Face model's key/value cache off: `batches.without_cache`)."""
        model = self.build()
        without_cache(model)
        return model


def rank_device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) on a CUDA mesh, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_in_layout(spec: TrainingSpec, layout: Layout, batch: Batch | None = None,
                    ) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[Batch], float], Any]:
    """(model, optimizer, train_step, device mesh) on this rank, for `layout`; the model is this
    rank's part (its pipeline stage's module for PP, traced on the global `batch`'s shape).

    Every rank builds the whole model from the same seed, then keeps its part: the weights are
    exactly those of a one-process `torch.manual_seed(seed); build()`, so a run can be checked
    against one.
    """
    if not dist.is_initialized():
        raise RuntimeError("the planner needs torch.distributed on the ranks (start the mesh with dist='gloo' or 'nccl')")
    if dist.get_world_size() != layout.world:
        raise ValueError(f"layout {layout} needs {layout.world} ranks; this mesh has {dist.get_world_size()}")
    device = rank_device()
    torch.manual_seed(spec.seed)
    model = spec.make().to(device)
    mesh = device_mesh(layout, device.type)
    local_inputs = None
    if layout.pp > 1:
        if batch is None:
            raise ValueError("a pipeline layout is built for a batch's shape: give the global batch")
        dp_rank = mesh["dp"].get_local_rank() if layout.data_parallel > 1 else 0
        shared = data_share(batch, layout.data_parallel, dp_rank)[0]
        if not isinstance(shared, torch.Tensor):
            raise ValueError("a pipeline takes one input tensor per micro-batch: this model's inputs are a dict "
                             "(model(**inputs)); use a layout without pp, or give it a tensor input")
        local_inputs = shared
    placed = place(model, layout, mesh, device, spec.loss, local_inputs)
    module = module_of(placed)
    optimizer = make_optimizer(spec.optimizer, module.parameters(), spec.lr)
    return module, optimizer, make_train_step(placed, optimizer, spec.loss, layout, mesh, device), mesh


def reference_losses(spec: TrainingSpec, batches: list[Batch]) -> list[float]:
    """The losses of the same training in one process, for comparison (one per batch)."""
    torch.manual_seed(spec.seed)
    model = spec.make()
    optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.lr)
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = spec.loss(forward(model, inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
