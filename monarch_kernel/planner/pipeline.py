"""Pipeline stages: the model traced and split at its block boundaries with torch's own
`torch.distributed.pipelining` (its tracing front end, `pipeline()` with `SplitPoint`s), one stage
per pipeline rank, trained with the 1F1B schedule over micro-batches.

Each stage gets a contiguous run of the model's repeated blocks (`structure.blocks`), as even as
the count allows; what comes before the first block (embeddings) goes with the first stage and
what follows the last (norm, head, loss) with the last. A data-parallel rank's share of the global
batch is cut into micro-batches (twice the stages when its size allows, else as many as the
stages); their shape is fixed when the model is traced, so every step takes a batch of the size
the stage was built for. The schedule scales each micro-batch's gradients by their count, so a
step's gradients are those of the mean loss over the share, as without stages.

The last stage hands on the model's output flattened (torch.export's leaves: a Hugging Face model's
`CausalLMOutputWithPast` arrives as a tuple holding the logits); the loss gets it rebuilt in the
model's own structure (`out.logits` works), from the output's structure found when it is traced.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from monarch_kernel.planner.structure import blocks


def tied_across_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """Pairs of names of one parameter used in two places not within one block (GPT-2's input embedding and
    output head share their weight): torch's pipelining gives each stage its own copy of such a parameter,
    and the copies would be trained apart."""
    block_paths = [path for path, _ in blocks(model)]

    def block_of(name: str) -> str:
        return next((path for path in block_paths if name.startswith(path + ".")), "")

    first: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        seen = first.setdefault(id(param), name)
        if seen != name and not (block_of(seen) and block_of(seen) == block_of(name)):
            tied.append((seen, name))
    return tied


def split_points(model: nn.Module, stages: int) -> list[str]:
    """The block paths where stages 1.. begin (ValueError if the model has fewer blocks than stages)."""
    found = [path for path, _ in blocks(model)]
    if len(found) < stages:
        raise ValueError(f"pipeline parallelism over {stages} stages needs at least {stages} repeated blocks "
                         f"(a ModuleList of layers) to split at; this model has {len(found)}")
    return [found[round(i * len(found) / stages)] for i in range(1, stages)]


def stage_blocks(model: nn.Module, stages: int, index: int) -> list[str]:
    """The block paths stage `index` holds."""
    found = [path for path, _ in blocks(model)]
    bounds = [round(i * len(found) / stages) for i in range(stages + 1)]
    return found[bounds[index]:bounds[index + 1]]


def microbatch_count(local_size: int, stages: int) -> int:
    """How many micro-batches a data-parallel share of `local_size` samples is cut into."""
    for count in (2 * stages, stages):
        if local_size % count == 0:
            return count
    raise ValueError(f"a data-parallel share of {local_size} samples does not split into {stages} equal "
                     f"micro-batches (one per pipeline stage at least): use a global batch that does")


@dataclass
class PipelineStage:
    """This rank's stage: its module, its schedule, and where it sits in the pipeline."""

    module: nn.Module
    schedule: Any
    index: int
    stages: int
    microbatches: int
    local_size: int  # the data-parallel share of samples a step takes

    @property
    def first(self) -> bool:
        """Whether the inputs enter here."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Whether the loss is computed here."""
        return self.index == self.stages - 1


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch's tracer warns about its own pytree internals (a deprecation inside torch): not the user's to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        yield


@dataclass
class TracedPipeline:
    """A model traced and split into stages (any rank's stage can be taken from it)."""

    pipe: Any
    stages: int
    microbatches: int
    local_size: int
    held: list[list[str]]  # each stage's block paths
    output_spec: Any = None  # the model's output structure (a pytree spec), for the loss


def output_structure(model: nn.Module, example: torch.Tensor) -> Any:
    """The pytree structure of `model(example)`, found on fake tensors (nothing is computed)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten

    with torch.no_grad():
        if detect_fake_mode((example,)) is not None:
            output = model(example)
        else:
            with FakeTensorMode(allow_non_fake_inputs=True):
                output = model(example)
    return tree_flatten(output)[1]


def structured_loss(loss_fn: Callable[..., torch.Tensor], spec: Any) -> Callable[..., torch.Tensor]:
    """`loss_fn` given the last stage's flattened output rebuilt as the model returns it (see the docstring)."""
    from torch.utils._pytree import tree_unflatten

    if spec is None or spec.is_leaf():
        return loss_fn

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        leaves = list(output) if isinstance(output, tuple | list) else [output]
        if len(leaves) == spec.num_leaves:
            output = tree_unflatten(leaves, spec)
        return loss_fn(output, target)

    return loss


def trace_pipeline(model: nn.Module, stages: int, local_inputs: torch.Tensor, device: torch.device) -> TracedPipeline:
    """Trace `model` on one micro-batch of `local_inputs` and split it at block boundaries."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    tied = tied_across_blocks(model)
    if tied:
        first, second = tied[0]
        raise ValueError(f"{first} and {second} are one parameter (tied weights) used in different pipeline stages: "
                         "torch's pipelining would give each stage its own copy and train them apart; plan it without "
                         "pp, or untie them")
    local_size = local_inputs.shape[0]
    count = microbatch_count(local_size, stages)
    points = split_points(model, stages)
    example = local_inputs[: local_size // count].to(device)
    with _quiet_torch():
        pipe = pipeline(model, mb_args=(example,), split_spec=dict.fromkeys(points, SplitPoint.BEGINNING))
    _check_contiguous_handoffs(pipe)
    held = [stage_blocks(model, stages, index) for index in range(stages)]
    return TracedPipeline(pipe, stages, count, local_size, held, output_structure(model, example))


def _check_contiguous_handoffs(pipe: Any) -> None:
    """ValueError if a stage hands the next one a tensor that is not contiguous (BERT's attention mask, expanded
    with a zero stride): torch's pipelining sends and receives it as it is, which the process group refuses
    ("input tensor has to be contiguous") on every step."""
    stages = list(pipe.split_gm.named_children())
    for index, (_, stage) in enumerate(stages[:-1]):
        output = next(node for node in stage.graph.nodes if node.op == "output")
        values = output.args[0] if isinstance(output.args[0], tuple | list) else [output.args[0]]
        for node in values:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor) and not value.is_contiguous():
                raise ValueError(f"stage {index} hands stage {index + 1} a tensor that is not contiguous ({node.name}, "
                                 f"shape {tuple(value.shape)}, strides {value.stride()}): torch's pipelining sends it as "
                                 "it is and the process group refuses it; plan this model without pp")


def take_stage(traced: TracedPipeline, mesh: Any, device: torch.device, loss_fn: Callable[..., torch.Tensor],
               shard: Callable[[nn.Module, list[str]], None] | None = None) -> PipelineStage:
    """This rank's stage of a traced pipeline (its index: this rank's place on the mesh's "pp"
    dimension), with its 1F1B schedule; `shard(stage_module, block_paths)` (FSDP) runs first."""
    from torch.distributed.pipelining import Schedule1F1B

    index = mesh["pp"].get_local_rank()
    with _quiet_torch():
        stage = traced.pipe.build_stage(index, device, group=mesh["pp"].get_group())
    if shard is not None:
        shard(stage.submod, traced.held[index])
    schedule = Schedule1F1B(stage, n_microbatches=traced.microbatches,
                            loss_fn=structured_loss(loss_fn, traced.output_spec))
    return PipelineStage(stage.submod, schedule, index, traced.stages, traced.microbatches, traced.local_size)


def pipeline_step(stage: PipelineStage, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """One forward and backward of a data-parallel share through the pipeline (no optimizer step);
    the mean loss of the share on the last stage, None on the others."""
    if inputs.shape[0] != stage.local_size:
        raise ValueError(f"this pipeline was built for a data-parallel share of {stage.local_size} samples, "
                         f"got {inputs.shape[0]}: train with global batches of the size it was planned for")
    losses: list[torch.Tensor] = []
    args = (inputs,) if stage.first else ()
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if stage.last else {}
    stage.schedule.step(*args, **kwargs)
    if not stage.last:
        return None
    return torch.stack([loss.detach() for loss in losses]).mean()
