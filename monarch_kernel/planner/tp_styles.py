"""Tensor-parallel styles for a layer torch's own styles refuse: the `Conv1D` of GPT-2 (and of other
Hugging Face models of its age), a linear layer that keeps its weight as (in, out), the transpose of
`nn.Linear`'s. Split by output features (colwise) its weight is sharded on dim 1 and its bias on dim 0;
by input features (rowwise) its weight on dim 0, the bias replicated. Inputs and outputs are prepared
exactly as torch's ColwiseParallel and RowwiseParallel prepare them for a Linear.

The torchrun scripts a plan writes carry these two classes' source (`styles_source`): they must not
need monarch_kernel. Import this module only where tensor parallelism is applied.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

STYLES_IMPORTS = ("from functools import partial", "from typing import Any", "import torch.nn as nn",
                  "from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor")


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


def styles_source() -> str:
    """The two classes' source, for a generated script (which imports STYLES_IMPORTS)."""
    return "\n\n".join(inspect.getsource(cls) for cls in (Conv1DColwise, Conv1DRowwise))
