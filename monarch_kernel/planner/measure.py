"""Measured on a live mesh's ranks (run there by the planner): their throughput, their links, the
memory they may use, and a layout's real steps (time and peak memory) for a trial."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from monarch_kernel.planner.apply import TrainingSpec, build_in_layout, rank_device
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.links import measure_links, median_seconds
from monarch_kernel.planner.parallelize import Batch

Links = dict[str, dict[str, list[float]]]  # scope ("intra", "inter") -> collective -> [latency, bandwidth, ranks]


@dataclass(frozen=True)
class RankFigures:
    """What one rank measured of itself and of the mesh's links (the answer of `MeasureRank`)."""

    flops_fp32: float  # matmul FLOP/s
    flops_bf16: float
    memory: float  # bytes this rank may use
    op_overhead: float  # seconds of one small operator
    dtensor_overhead: float  # what a DTensor adds to it
    links: Links
    intra_host_bandwidth: float  # all_reduce bytes/s among the ranks of a host
    inter_host_bandwidth: float  # ... across the mesh
    latency: float  # the slower all_reduce latency of the two


@dataclass(frozen=True)
class TrialMeasurement:
    """One rank's steps of a layout run for real (the answer of `TrialLayout`)."""

    step_seconds: float  # the median step
    peak_bytes: float  # the peak memory of a step


def rank_figures() -> RankFigures:
    """This rank's fp32 and bf16 matmul FLOP/s, its per-operator costs, its memory to use (free GPU memory,
    or a fair share of the host's available memory), and the mesh's links (`links.py`)."""
    device = rank_device()
    n = 1024 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    torch.mm(a, b)
    flops = 2 * n ** 3 / median_seconds(lambda: torch.mm(a, b), 5, device)
    a16, b16 = a.bfloat16(), b.bfloat16()
    torch.mm(a16, b16)
    flops_bf16 = 2 * n ** 3 / median_seconds(lambda: torch.mm(a16, b16), 3, device)
    small = torch.ones(16, device=device)
    op_overhead = median_seconds(lambda: [torch.add(small, small) for _ in range(200)], 3) / 200
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    replicated = distribute_tensor(small, init_device_mesh(device.type, (dist.get_world_size(),)), [Replicate()])
    dtensor_overhead = median_seconds(lambda: [torch.add(replicated, replicated) for _ in range(100)], 3) / 100
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _available_host_memory() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    links = measure_links(device)
    intra = links["intra"].get("all_reduce", [0.0, float("inf"), 1.0])
    inter = links["inter"].get("all_reduce", intra)
    return RankFigures(flops_fp32=flops, flops_bf16=flops_bf16, memory=float(free), op_overhead=op_overhead,
                       dtensor_overhead=max(0.0, dtensor_overhead - op_overhead), links=links,
                       intra_host_bandwidth=intra[1], inter_host_bandwidth=inter[1], latency=max(intra[0], inter[0]))


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def trial_layout(spec: TrainingSpec, layout: Layout, batch: Batch, steps: int) -> TrialMeasurement:
    """Build the layout for real, run `steps` steps (the first warms up), and measure on this rank:
    the median step time and the peak memory of a step (GPU: max_memory_allocated; CPU: torch's
    memory tracker around a real step)."""
    model, optimizer, step, _ = build_in_layout(spec, layout, batch)
    step(batch)  # warm-up: the optimizer's state is made here
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        times = [median_seconds(lambda: step(batch), 1, device) for _ in range(max(1, steps - 1))]
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        times = [median_seconds(lambda: step(batch), 1) for _ in range(max(1, steps - 2))]
        peak = float(_tracked_peak(model, optimizer, step, batch, layout))
    return TrialMeasurement(statistics.median(times), peak)


def _tracked_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[Batch], float],
                  batch: Batch, layout: Layout) -> int:
    from monarch_kernel.planner.trackers import memory_tracker, peak_by_category

    plain = getattr(model, "module", model)  # (DDP's wrapper: track the model inside)
    tracker = memory_tracker(plain, optimizer, fsdp=layout.fsdp > 1)
    with tracker:
        step(batch)
    return sum(peak_by_category(tracker).values())  # (DDP's buckets are the gradients it sees)
