"""Tensor-parallel styles for layers torch's own styles refuse.

- The `Conv1D` of GPT-2 (and of other Hugging Face models of its age), a linear layer that keeps its
  weight as (in, out), the transpose of `nn.Linear`'s. Split by output features (colwise) its weight
  is sharded on dim 1 and its bias on dim 0; by input features (rowwise) its weight on dim 0, the bias
  replicated. Inputs and outputs are prepared exactly as torch's ColwiseParallel and RowwiseParallel
  prepare them for a Linear.
- `nn.EmbeddingBag`, the pooled lookup of recommenders' sparse features, which DTensor has no rule
  for: its table is split by columns (each rank keeps every row's slice of the embedding dimension),
  each rank pools its columns for the whole batch, and the pooled slices are gathered (one
  all-gather per lookup; in the backward each rank keeps its slice of the gradient, no
  communication). Exact for every pooling mode (sum, mean, max), since pooling runs per column.
- A mixture of experts' stacked weights (Hugging Face's experts modules: `gate_up_proj`,
  `down_proj`, one slice per expert), split by experts: expert parallelism inside the
  tensor-parallel group, whose ranks see the same tokens. Each rank runs only its own experts on
  the tokens routed to them (the others' ids become the sentinel `num_experts`, which
  transformers' experts implementations skip, their routing weights zero), and one all-reduce
  sums the experts' outputs; in the backward the gradients of the tokens and routing weights are
  summed over the group the same way, since each rank's experts saw only their share.

The torchrun scripts a plan writes carry these classes' source (`styles_source`): they must not
need monarch_kernel. Import this module only where tensor parallelism is applied.
"""

from __future__ import annotations

import inspect
import types
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

STYLES_IMPORTS = ("import types", "from functools import partial", "from typing import Any", "import torch",
                  "import torch.nn as nn", "import torch.nn.functional as F",
                  "from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module,"
                  " distribute_tensor",
                  "from torch.distributed.tensor.parallel import ParallelStyle")


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for a Conv1D (weight (in, out)): weight sharded on dim 1, bias on dim 0."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in module.named_parameters():
            placement = Shard(1) if param.dim() == 2 else Shard(0)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for a Conv1D (weight (in, out)): weight sharded on dim 0, bias replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in module.named_parameters():
            placement = Shard(0) if param.dim() == 2 else Replicate()
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _pooled_by_columns(self: nn.EmbeddingBag, input: torch.Tensor, offsets: torch.Tensor | None = None,
                       per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """EmbeddingBag.forward on a table split by columns: this rank's columns pooled, then all columns gathered."""
    weight = self.weight
    assert isinstance(weight, DTensor)
    pooled = F.embedding_bag(input, weight.to_local(), offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                             self.mode, self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)
    return DTensor.from_local(pooled, weight.device_mesh, [Shard(pooled.dim() - 1)], run_check=False).full_tensor()


class EmbeddingBagColwise(ParallelStyle):
    """An nn.EmbeddingBag's table split by columns over the mesh (see the module docstring); its inputs are
    the same on every rank (the tensor-parallel ranks take the same share of the batch), its output whole."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.EmbeddingBag):
            raise ValueError(f"EmbeddingBagColwise takes an nn.EmbeddingBag, not {type(module).__name__}")
        weight = module.weight
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight.data, device_mesh, [Shard(1)],
                                                                           src_data_rank=self.src_data_rank),
                                                         requires_grad=weight.requires_grad))
        module.forward = types.MethodType(_pooled_by_columns, module)  # type: ignore[method-assign]
        return module


class _LocalExperts:
    """An experts module as its forward sees it on one rank: this rank's experts only."""

    def __init__(self, module: nn.Module, local: dict[str, torch.Tensor], count: int) -> None:
        self._module, self._local = module, local
        self.num_experts, self._is_expert_parallel = count, True

    def __getattr__(self, name: str) -> Any:
        return self._local[name] if name in self._local else getattr(self._module, name)


def _experts_of_this_rank(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward with the experts split over the group (see the module docstring)."""
    stacked = {name: param for name, param in self.named_parameters(recurse=False) if isinstance(param, DTensor)}
    mesh = next(iter(stacked.values())).device_mesh
    local = {name: param.to_local() for name, param in stacked.items()}
    count = next(iter(local.values())).shape[0]
    first = mesh.get_local_rank() * count
    ids = top_k_index - first
    elsewhere = (ids < 0) | (ids >= count)

    def summed_in_backward(tensor: torch.Tensor) -> torch.Tensor:  # the same on every rank; gradients partial
        whole = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
        return whole.to_local(grad_placements=[Partial()])

    weights = summed_in_backward(top_k_weights).masked_fill(elsewhere, 0.0)
    forward = type(self).forward
    out = forward(_LocalExperts(self, local, count), summed_in_backward(hidden_states), ids.masked_fill(elsewhere, count),
                  weights)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).full_tensor()


class ExpertsSharded(ParallelStyle):
    """A mixture of experts' stacked weights split by experts over the mesh (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))
        module.forward = types.MethodType(_experts_of_this_rank, module)
        return module


def styles_source() -> str:
    """The styles' source, for a generated script (which imports STYLES_IMPORTS)."""
    return "\n\n".join(inspect.getsource(obj) for obj in (Conv1DColwise, Conv1DRowwise, _pooled_by_columns,
                                                              EmbeddingBagColwise, _LocalExperts,
                                                              _experts_of_this_rank, ExpertsSharded))
