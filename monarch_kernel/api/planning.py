"""`mesh.plan(...)` and `monarch_kernel.plan(..., world=...)`: which layouts fit, which is fastest.

Every candidate layout of the mesh's shape is estimated on fake tensors in a helper process of
its own (in parallel; the notebook allocates nothing of the model), its step time modelled
from its FLOPs and collective bytes with the ranks' measured throughput and links (or a known
accelerator's figures for a cluster you do not have), and ranked. `Plan.trial` runs the fitting
ones for real and re-ranks by measurement; `Plan.apply` builds the model on the ranks in a
layout; `Plan.code` writes the same as a torchrun script.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from monarch_kernel.api.estimate_helpers import run_estimates
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.texttable import text_table
from monarch_kernel.planner.apply import TrainingSpec
from monarch_kernel.planner.batches import batch_size, check_batch
from monarch_kernel.planner.estimate import CATEGORIES, LayoutEstimate
from monarch_kernel.planner.flops import ModelFlops
from monarch_kernel.planner.hardware import (
    Accelerator,
    Figures,
    accelerator,
    parse_bytes,
    size_text,
)
from monarch_kernel.planner.layout import POLICIES, PRECISIONS, STRATEGIES, Layout, candidate_layouts
from monarch_kernel.planner.pipeline import microbatch_count
from monarch_kernel.planner.step_time import comm_seconds, compute_seconds


@dataclass
class Candidate:
    """One layout: estimated (and, after a trial, measured) per rank."""

    layout: str
    fits: bool = False
    peak_bytes: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    step_seconds: float = float("inf")
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    flops: float = 0.0  # one rank's FLOPs per step (forward, backward and any recompute)
    collectives: dict[str, int] = field(default_factory=dict)
    modules: dict[str, dict[str, int]] = field(default_factory=dict)  # per_module=True: name -> params, peak
    reason: str = ""  # why it does not fit, or does not apply
    applicable: bool = True
    measured_peak_bytes: float | None = None
    measured_step_seconds: float | None = None

    def row(self) -> list[str]:
        """Its cells in the plan's table."""
        measured = ("" if self.measured_step_seconds is None else
                    f"{self.measured_step_seconds * 1e3:.1f} ms, {size_text(self.measured_peak_bytes or 0)}")
        if not self.applicable:
            return [self.layout, "n/a", "", "", "", self.reason]
        return [self.layout, "yes" if self.fits else "no", size_text(self.peak_bytes),
                f"{self.step_seconds * 1e3:.1f} ms", measured, self.reason]


@dataclass
class Plan:
    """The candidates of one model on one mesh (or world), best first; see the module docstring."""

    candidates: list[Candidate]
    figures: Figures
    hosts: int
    gpus: int
    spec: TrainingSpec
    batch: Callable[[], Any]
    mesh: Any = None  # the Mesh it was made for (None: a world you do not have yet)
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        """The fastest fitting candidate (by measurement once trialled)."""
        fitting = [c for c in self.candidates if c.fits]
        if not fitting:
            return None
        measured = [c for c in fitting if c.measured_step_seconds is not None]
        if measured:
            return min(measured, key=lambda c: c.measured_step_seconds or float("inf"))
        return min(fitting, key=lambda c: c.step_seconds)

    def candidate(self, layout: str | Candidate | None = None) -> Candidate:
        """The candidate of a layout string (None: the best)."""
        if isinstance(layout, Candidate):
            return layout
        if layout is None:
            found = self.best
            if found is None:
                raise MeshUsageError("no layout fits: give more memory per rank, more ranks, or a smaller batch")
            return found
        text = Layout.parse(layout).text
        for candidate in self.candidates:
            if candidate.layout == text:
                return candidate
        raise MeshUsageError(f"layout {layout!r} is not a candidate of this plan ({', '.join(self.layouts())})")

    def layouts(self) -> list[str]:
        """The candidates' layout strings, in the plan's order."""
        return [c.layout for c in self.candidates]

    def _rows(self) -> list[list[str]]:
        return [["layout", "fits", "peak/rank", "step (est.)", "measured", "why"], *(c.row() for c in self.candidates)]

    def __str__(self) -> str:
        world = f"{self.hosts} x {self.gpus} ranks"
        head = (f"Plan for {world}, {size_text(self.figures.memory)} per rank ({self.figures.source}); "
                f"best: {self.best.layout if self.best else 'none fits'}")
        return "\n".join([head, *text_table(self._rows(), "  "), *self.notes])

    __repr__ = __str__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        rows = self._rows()
        best = self.best.layout if self.best else None
        cells = "".join(
            "<tr" + (" style='font-weight:bold'" if row[0] == best else "") + ">"
            + "".join(f"<t{'h' if i == 0 else 'd'}>{html.escape(cell)}</t{'h' if i == 0 else 'd'}>" for cell in row)
            + "</tr>" for i, row in enumerate(rows))
        head = html.escape(str(self).splitlines()[0])
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
        return f"<div><div>{head}</div><table>{cells}</table>{notes}</div>"

    # ------------------------------------------------------------ on the mesh
    def trial(self, steps: int = 3) -> Plan:
        """Run every fitting candidate for real on the mesh, measure its step and peak, re-rank."""
        from monarch_kernel.api.plan_on_mesh import trial

        trial(self, steps)
        return self

    def apply(self, candidate: str | Candidate | None = None, *, seed: int = 0,
              names: tuple[str, str, str] = ("model", "optimizer", "train_step")) -> Candidate:
        """Build the model on every rank in a layout (the best by default) and bind its module,
        optimizer and train_step(batch) under `names` on each rank; returns the candidate."""
        from monarch_kernel.api.plan_on_mesh import apply

        return apply(self, self.candidate(candidate), seed, names)

    def code(self, steps: int = 10, candidate: str | Candidate | None = None) -> str:
        """A standalone torchrun script doing the same: build, parallelize, `steps` train steps."""
        from monarch_kernel.planner.codegen import torchrun_script

        chosen = self.candidate(candidate)
        return torchrun_script(self.spec, self.batch, Layout.parse(chosen.layout), steps)


def add_flops(counted: ModelFlops, estimates: list[LayoutEstimate], notes: list[str]) -> None:
    """Each estimate's FLOPs per rank from the model's count (pipelines count their own)."""
    if counted.batch_norms:
        notes.append(f"{counted.batch_norms} BatchNorm layers: with data parallelism their statistics span the "
                     "data-parallel ranks (SyncBatchNorm on GPUs, SyncedBatchNorm on CPU), so training matches one "
                     "process; pipeline stages keep each rank's own statistics")
    if counted.error:
        notes.append(f"the model's FLOPs could not be counted ({counted.error}): step times without pipeline stages "
                     "leave out compute")
    for estimate in estimates:
        if estimate.layout in counted.per_rank:
            estimate.flops = counted.per_rank[estimate.layout]
            estimate.param_count = counted.param_count  # (its dtype_bytes, the compute's, the estimate set)


def rank_candidates(estimates: list[LayoutEstimate], figures: Figures, hosts: int, gpus: int,
                    known: Accelerator | None = None) -> list[Candidate]:
    """Candidates from estimates: fit against the memory per rank, step time from FLOPs and bytes."""
    found = []
    for estimate in estimates:
        layout = Layout.parse(estimate.layout)
        if estimate.error:
            found.append(Candidate(estimate.layout, applicable=False, reason=estimate.error))
            continue
        candidate = Candidate(estimate.layout, peak_bytes=estimate.peak_bytes, memory=dict(estimate.memory),
                              collectives=dict(estimate.collectives), modules=dict(estimate.modules),
                              flops=estimate.flops)
        flops = known.flops(estimate.dtype_bytes) if known is not None else figures.compute_rate(estimate.dtype_bytes)
        candidate.compute_seconds = compute_seconds(estimate, layout, figures, flops)
        candidate.comm_seconds = comm_seconds(estimate, layout, figures, hosts, gpus)
        candidate.step_seconds = candidate.compute_seconds + candidate.comm_seconds
        candidate.fits = candidate.peak_bytes <= figures.memory
        if not candidate.fits:
            biggest = max(CATEGORIES, key=lambda k: estimate.memory.get(k, 0))
            candidate.reason = (f"needs {size_text(candidate.peak_bytes)} per rank, over {size_text(figures.memory)} "
                                f"(largest: {biggest} {size_text(estimate.memory.get(biggest, 0))})")
        found.append(candidate)
    return sorted(found, key=lambda c: (not c.applicable, not c.fits, c.step_seconds))


def plan(build: Callable[[], Any], batch: Callable[[], Any], *, loss: Callable[..., Any],
         optimizer: str | Callable[..., Any] = "adamw", lr: float | None = None, memory: str | int = "auto",
         world: dict[str, int] | None = None, device: str | Accelerator | None = None,
         strategies: Sequence[str] = STRATEGIES, mesh: Any = None, per_module: bool = False,
         precision: str = "fp32") -> Plan:
    """Plan how to split `build()` over a mesh (`mesh.plan`) or a world you do not have yet
    (`world={"hosts": 4, "gpus": 8}, device="H100"`); see the module docstring. per_module: each
    candidate's `modules` holds every module's (two levels deep) parameter bytes and peak.
    precision: "fp32" trains as the model is built; "bf16" in mixed precision (every layout with
    mp=bf16: bf16 compute on fp32 master weights, gradients reduced in fp32)."""
    if precision not in PRECISIONS:
        raise MeshUsageError(f"precision {precision!r}: use 'fp32' (as the model is built) or 'bf16' (mixed precision: "
                             "bf16 compute on fp32 master weights)")
    unknown = set(strategies) - set(STRATEGIES + POLICIES)
    if unknown:
        raise MeshUsageError(f"unknown strategies {sorted(unknown)}: use some of {', '.join(STRATEGIES + POLICIES)} "
                             "(ac: each layout also with activation checkpointing on every block)")
    spec = TrainingSpec(build, loss, optimizer, lr)
    if mesh is not None:
        from monarch_kernel.api.plan_on_mesh import mesh_figures

        hosts, gpus = mesh.shape.sizes.get("hosts", 1), mesh.shape.sizes.get("gpus", 1)
        figures = mesh_figures(mesh)
    else:
        if world is None or device is None:
            raise MeshUsageError("plan() without a mesh needs world={'hosts': H, 'gpus': G} and device= "
                                 "(a name such as 'H100', or an Accelerator)")
        hosts, gpus = int(world.get("hosts", 1)), int(world.get("gpus", 1))
        named = accelerator(device)
        figures = Figures(named.memory, named.flops_fp32, named.intra_host_bandwidth, named.inter_host_bandwidth,
                          named.name, flops_bf16=named.flops_bf16)
    if memory != "auto":
        figures.memory = parse_bytes(memory)
    try:
        global_batch = check_batch(batch())
    except ValueError as exc:
        raise MeshUsageError(str(exc)) from None
    layouts = candidate_layouts(hosts, gpus, tuple(strategies))
    notes: list[str] = []
    usable = []
    size = batch_size(global_batch[0])
    for layout in layouts:
        if precision != "fp32" and layout.pp > 1:
            notes.append(f"{layout}: ruled out: pipeline stages are not planned in mixed precision")
            continue
        layout = layout.with_precision(precision)
        if layout.pp > 1 and not isinstance(global_batch[0], torch.Tensor):
            notes.append(f"{layout}: ruled out: a pipeline takes one input tensor per micro-batch, and this "
                         "model's inputs are a dict (model(**inputs))")
            continue
        if size % layout.data_parallel:
            notes.append(f"{layout}: ruled out: the global batch of {size} does not split over "
                         f"{layout.data_parallel} data-parallel ranks")
            continue
        if layout.pp > 1:
            try:
                microbatch_count(size // layout.data_parallel, layout.pp)
            except ValueError as exc:
                notes.append(f"{layout}: ruled out: {exc}")
                continue
        usable.append(layout)
    device_type = "cuda" if mesh is None or mesh.backend == "nccl" else "cpu"  # (named devices are GPUs)
    estimates, counted = run_estimates(spec, global_batch, usable, per_module=per_module, device_type=device_type)
    add_flops(counted, estimates, notes)
    known = accelerator(device) if device is not None and mesh is None else None
    candidates = rank_candidates(estimates, figures, hosts, gpus, known)
    return Plan(candidates, figures, hosts, gpus, spec, batch, mesh, notes)
