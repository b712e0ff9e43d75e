"""One layout estimated on fake tensors: memory per category, collective bytes and calls per
step (and, through a pipeline, each stage's FLOPs; other layouts' FLOPs come from `flops.py`).

It runs the layout's real code (`parallelize` or the pipeline's stage and schedule, the
optimizer, a training step on rank 0's slice of the batch, after the optimizer's state has been
made) under FakeTensorMode with torch's fake process group, so no memory is allocated and no
rank is needed: torch's own trackers (`FSDPMemTracker` for FSDP layouts, `MemTracker`
otherwise) record what the step holds at its peak, and a dispatch mode records the bytes of
every collective. It needs a process of its own (the fake group becomes the default group):
`estimate_job` runs it so.

DDP keeps its gradients in its buckets (`gradient_as_bucket_view`): they are allocated once and
held through the whole step, forward included, where a plain model's gradients only appear in the
backward; the estimate runs the plain model with its gradients kept the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from monarch_kernel.planner.apply import TrainingSpec
from monarch_kernel.planner.batches import each, forward
from monarch_kernel.planner.fake_build import build_fake, lenient_grouped_mm
from monarch_kernel.planner.layout import TP, Layout
from monarch_kernel.planner.parallelize import (
    Batch,
    autocast,
    data_share,
    device_mesh,
    make_local_step,
    make_optimizer,
    module_of,
    parallelize,
    place,
    synchronized,
)
from monarch_kernel.planner.pipeline import PipelineStage
from monarch_kernel.planner.trackers import CATEGORIES, memory_tracker, peak_by_category, track_optimizer_state

__all__ = ["CATEGORIES", "LayoutEstimate", "estimate_layout"]


@dataclass
class LayoutEstimate:
    """What one rank of a layout holds and does per training step (the rank that peaks highest)."""

    layout: str
    memory: dict[str, int] = field(default_factory=dict)  # CATEGORIES -> bytes at the peak
    flops: float = 0.0  # per rank per step (pipelines: the slowest stage's; others: filled in from flops.py)
    collectives: dict[str, int] = field(default_factory=dict)  # kind -> bytes per rank per step
    collective_calls: int = 0  # how many collectives a step runs (each costs the links' latency)
    calls: dict[str, int] = field(default_factory=dict)  # ... by kind
    ops: int = 0  # operators a step dispatches (each costs the rank's per-operator overhead)
    dtensor_ops: int = 0  # ... of which on DTensors (each also costs DTensor's sharding propagation)
    param_count: int = 0
    dtype_bytes: int = 4  # of what it computes in: the parameters', 2 with mp=bf16 (which FLOP/s figure applies)
    modules: dict[str, dict[str, int]] = field(default_factory=dict)  # on request: module -> params, peak bytes
    microbatches: int = 1  # per step, through a pipeline
    stage_peaks: list[int] = field(default_factory=list)  # PP: each stage's peak bytes
    error: str = ""

    @property
    def peak_bytes(self) -> int:
        """The sum of the categories at the peak."""
        return sum(self.memory.values())


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def module_peaks(tracker: Any, depth: int) -> dict[str, dict[str, int]]:
    """Each tracked module's parameter bytes and its peak (bytes held while it ran), by name."""
    found = {}
    for stats in list(tracker.memory_tracking.values()):
        name = getattr(stats, "mod_fqn", "")
        if not name or name.count(".") > depth:
            continue
        peaks = getattr(stats, "local_peak", {}) or {}
        found[name] = {"params": int(getattr(stats, "parameter_mem", 0)), "peak": int(max(peaks.values(), default=0))}
    return dict(sorted(found.items()))


def _collective_recorder(tp_group: str | None = None) -> Any:
    """A dispatch mode counting collectives; those on the group named `tp_group` are filed as `kind + TP`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveBytes(TorchDispatchMode):
        """Bytes of every collective a step runs (the largest tensor it moves), by kind."""

        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, int] = {}
            self.calls_by_kind: dict[str, int] = {}
            self.calls = 0
            self.ops = 0
            self.dtensor_ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                self.dtensor_ops += 1
            if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func._opname:
                self.calls += 1
                leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                size = max((t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)), default=0)
                kind = _collective_kind(func._opname)
                if tp_group is not None and any(_group_name(leaf) == tp_group for leaf in leaves):
                    kind += TP
                self.bytes[kind] = self.bytes.get(kind, 0) + size
                self.calls_by_kind[kind] = self.calls_by_kind.get(kind, 0) + 1
            return out

    return CollectiveBytes()


def _group_name(value: Any) -> str | None:
    """The process group an argument of a collective names: functional collectives pass its name, c10d's own
    ops the group."""
    if isinstance(value, str):
        return value
    name = getattr(value, "group_name", None)
    return name if isinstance(name, str) else None


def tp_group_name(layout: Layout, mesh: Any) -> str | None:
    """The name of a layout's tensor-parallel process group (None without TP)."""
    return mesh["tp"].get_group().group_name if layout.tp > 1 else None


def _collective_kind(opname: str) -> str:
    name = opname.strip("_")
    for kind in ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "send", "recv"):
        if kind in name:
            return {"allgather": "all_gather", "allreduce": "all_reduce"}.get(kind, kind)
    return name


def _fake_friendly_device_mesh() -> None:
    """FSDP over a tensor-parallel model joins the two mesh dimensions, computing coordinates with
    tensors: under FakeTensorMode those would be fake. Let that bookkeeping run on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    real = DeviceMesh._concatenate
    if getattr(real, "_monarch_real", False):
        return

    def concatenate(meshes: list[Any]) -> Any:
        with unset_fake_temporarily():
            return real(meshes)

    concatenate._monarch_real = True  # type: ignore[attr-defined]
    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]


@contextlib.contextmanager
def _sharding_propagation_apart() -> Iterator[None]:
    """DTensor works out each operator's output shapes on fake tensors of the whole (unsharded) shapes, in the
    fake mode it finds active: in an estimate, ours, where torch's memory tracker takes those whole-size results
    for this rank's memory (an AdamW step on a table split 8 ways counted three whole copies of the table). Give
    that propagation a fake mode of its own, which the tracker leaves out, as it does when ranks run for real."""
    from torch.distributed.tensor import _sharding_prop

    own = FakeTensorMode()
    found = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: own
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = found


@contextlib.contextmanager
def _gloo_reduce_scatter_copies() -> Iterator[None]:
    """gloo, the CPU ranks' backend, reduce-scatters by all-reducing a copy of the whole input and keeping this
    rank's chunk of it (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`): while the collective runs, a rank
    holds one more input-sized tensor, which the fake group never allocates. Under this, a reduce-scatter in the
    estimate makes the same copy and holds it until the collective returns (FSDP's reduce-scatters are
    synchronous; an asynchronous one is counted as if it were). NCCL needs no such copy."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    plain = c10d.reduce_scatter_single

    def with_gloos_copy(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                        async_op: bool = False) -> Any:
        copy = input.clone()  # noqa: F841 - held for the collective's time, as gloo holds its own
        return plain(output, input, op=op, group=group, async_op=async_op)

    c10d.reduce_scatter_single = dist.reduce_scatter_single = with_gloos_copy  # (reduce_scatter_tensor calls c10d's)
    try:
        yield
    finally:
        c10d.reduce_scatter_single = dist.reduce_scatter_single = plain


def estimate_layout(spec: TrainingSpec, batch: Batch, layout: Layout, *, per_module: bool = False,
                    depth: int = 2, device_type: str = "cuda") -> LayoutEstimate:
    """Estimate `layout` in this process (which must have no process group of its own: see `estimate_job`).

    per_module: also each module's parameter bytes and the peak while it ran, for modules at
    most `depth` levels below the model. device_type: the ranks' ("cpu": the CPU kernels' dtypes are
    taken where torch's fake kernels follow the GPU's, `fake_build.lenient_grouped_mm`, and reduce-scatters
    hold gloo's copy of their input, `_gloo_reduce_scatter_copies`).
    """
    on_cpu = device_type == "cpu"
    with lenient_grouped_mm() if on_cpu else contextlib.nullcontext(), _sharding_propagation_apart(), \
            _gloo_reduce_scatter_copies() if on_cpu else contextlib.nullcontext():
        return _estimate_layout(spec, batch, layout, per_module, depth)


def _estimate_layout(spec: TrainingSpec, batch: Batch, layout: Layout, per_module: bool, depth: int) -> LayoutEstimate:
    local = data_share(batch, layout.data_parallel, 0)
    if layout.pp > 1:
        return _estimate_pipeline(spec, local, layout, per_module, depth)
    result = LayoutEstimate(layout.text)
    with _fake_group(layout, rank=0):
        mesh = device_mesh(layout, "cpu")
        recorder = _collective_recorder(tp_group_name(layout, mesh))
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model = build_fake(spec.make, fake)
            if layout.fsdp > 1 or layout.tp > 1:  # (DDP alone: the plain model, its gradients held as its buckets)
                model = parallelize(model, layout, mesh)
            else:
                model = synchronized(model, layout, mesh)
            optimizer = make_optimizer(spec.optimizer, model.parameters(), spec.lr)
            inputs, targets = each(local[0], fake.from_tensor), fake.from_tensor(local[1])
            tracker = memory_tracker(model, optimizer, fsdp=layout.fsdp > 1, per_module=per_module)
            with tracker:
                make_optimizer_state(model, optimizer, tracker)  # a step in the steady state holds it
                if layout.ddp > 1 and layout.tp == 1:  # DDP's buckets: the gradients, held all along
                    for param in model.parameters():
                        if param.requires_grad:
                            param.grad = torch.zeros_like(param)
                tracker.reset_mod_stats()
                with recorder:
                    with autocast(layout, "cpu"):
                        value = spec.loss(forward(model, inputs), targets)
                    value.backward()
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if per_module:
                result.modules = module_peaks(tracker, depth)
        memory = peak_by_category(tracker, optimizer)
        result.collectives = dict(recorder.bytes)
        result.collective_calls, result.ops, result.dtensor_ops = recorder.calls, recorder.ops, recorder.dtensor_ops
        result.calls = dict(recorder.calls_by_kind)
        if layout.ddp > 1:  # the gradients' all-reduce, in DDP's buckets (with TP: averaged in place)
            grads = sum(local_bytes(p) for p in model.parameters() if p.requires_grad)
            result.collectives["all_reduce"] = result.collectives.get("all_reduce", 0) + grads
            grad_count = sum(1 for p in model.parameters() if p.requires_grad)
            calls = grad_count if layout.tp > 1 else max(1, -(-grads // (25 << 20)))  # DDP: 25 MB buckets
            result.collective_calls += calls
            result.calls["all_reduce"] = result.calls.get("all_reduce", 0) + calls
        result.memory = memory
        result.dtype_bytes = 2 if layout.mp else next((p.element_size() for p in model.parameters()), 4)
    return result


def make_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, tracker: Any = None) -> None:
    """The optimizer's state as after a first step, without running the model (the forward and backward are
    most of an estimate's time): Adam's and AdamW's made as their first step makes it, and filed with the
    tracker as optimizer state; any other's by one optimizer step on zero gradients."""
    if tracker is not None and _make_adam_state(optimizer):
        track_optimizer_state(tracker, optimizer)
        return
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _make_adam_state(optimizer: torch.optim.Optimizer) -> bool:
    """Adam's or AdamW's state as its first step makes it (a step count, the two moments); False for any other
    optimizer, or options that change the state (amsgrad, fused, capturable)."""
    from torch.optim.optimizer import _get_scalar_dtype

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or any(
            group.get("amsgrad") or group.get("fused") or group.get("capturable") or group.get("differentiable")
            for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                optimizer.state[param] = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
                                          "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                                          "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
    return True


@contextlib.contextmanager
def _fake_group(layout: Layout, rank: int) -> Iterator[None]:
    """torch's fake process group as the default group, this process playing `rank` of the layout."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        _fake_friendly_device_mesh()
        yield
    finally:
        dist.destroy_process_group()


def _estimate_pipeline(spec: TrainingSpec, local: Batch, layout: Layout, per_module: bool,
                       depth: int) -> LayoutEstimate:
    """Each stage in turn, this process playing its first rank, through the layout's real schedule
    and step; the layout's memory is the stage that peaks highest, its compute the slowest stage."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils.flop_counter import FlopCounterMode

    from monarch_kernel.planner.pipeline import trace_pipeline

    result = LayoutEstimate(layout.text)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        model = build_fake(spec.make, fake)
        params = list(model.parameters())
        result.param_count = sum(p.numel() for p in params)
        result.dtype_bytes = params[0].element_size() if params else 4
        if not isinstance(local[0], torch.Tensor):
            raise ValueError("a pipeline takes one input tensor per micro-batch: this model's inputs are a dict "
                             "(model(**inputs)); plan it without pp, or give it a tensor input")
        inputs, targets = fake.from_tensor(local[0]), fake.from_tensor(local[1])
        traced = trace_pipeline(model, layout.pp, inputs, torch.device("cpu"))  # once: every stage comes from it
        for index in range(layout.pp):
            with _fake_group(layout, rank=index * layout.data_parallel):
                with unset_fake_temporarily():
                    mesh = device_mesh(layout, "cpu")
                recorder = _collective_recorder(tp_group_name(layout, mesh))
                placed = place(traced, layout, mesh, torch.device("cpu"), spec.loss)
                assert isinstance(placed, PipelineStage)
                module = module_of(placed)
                optimizer = make_optimizer(spec.optimizer, module.parameters(), spec.lr)
                step = make_local_step(placed, optimizer, spec.loss, layout, mesh)
                tracker = memory_tracker(module, optimizer, fsdp=layout.fsdp > 1, per_module=per_module)
                counter = FlopCounterMode(display=False)
                with tracker:
                    make_optimizer_state(module, optimizer, tracker)
                    tracker.reset_mod_stats()
                    with recorder, counter:
                        step(inputs, targets)
                memory = peak_by_category(tracker, optimizer)
                peak = sum(memory.values())
                result.stage_peaks.append(peak)
                if peak >= max(result.stage_peaks):
                    result.memory = memory
                    if per_module:
                        result.modules = module_peaks(tracker, depth)
                result.microbatches = placed.microbatches
                result.flops = max(result.flops, float(counter.get_total_flops()))
                result.ops = max(result.ops, recorder.ops)
                result.dtensor_ops = max(result.dtensor_ops, recorder.dtensor_ops)
                result.collective_calls = max(result.collective_calls, recorder.calls)
                for kind, size in recorder.bytes.items():
                    result.collectives[kind] = max(result.collectives.get(kind, 0), size)
                for kind, count in recorder.calls_by_kind.items():
                    result.calls[kind] = max(result.calls.get(kind, 0), count)
    return result
