"""Measured on a live mesh's ranks (run there by the planner): their throughput, their links, the
memory they may use, and a layout's real steps (time and peak memory) for a trial."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.planner.apply import TrainingSpec, build_in_layout, rank_device
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.links import measure_links, median_seconds
from monarch_kernel.planner.parallelize import Batch


def rank_figures() -> dict[str, Any]:
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
    figures: dict[str, Any] = {"flops_fp32": flops, "flops_bf16": flops_bf16, "memory": float(free), "op_overhead": op_overhead,
               "dtensor_overhead": max(0.0, dtensor_overhead - op_overhead)}
    links = measure_links(device)
    figures["links"] = links
    intra = links["intra"].get("all_reduce", [0.0, float("inf"), 1.0])
    inter = links["inter"].get("all_reduce", intra)
    figures["intra_host_bandwidth"], figures["inter_host_bandwidth"] = intra[1], inter[1]
    figures["latency"] = max(intra[0], inter[0])
    return figures


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def trial_layout(spec: TrainingSpec, layout: Layout, batch: Batch, steps: int) -> dict[str, float]:
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
    return {"step_seconds": statistics.median(times), "peak_bytes": peak}


def _tracked_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[Batch], float],
                  batch: Batch, layout: Layout) -> int:
    from monarch_kernel.planner.trackers import memory_tracker, peak_by_category

    plain = getattr(model, "module", model)  # (DDP's wrapper: track the model inside)
    tracker = memory_tracker(plain, optimizer, fsdp=layout.fsdp > 1)
    with tracker:
        step(batch)
    return sum(peak_by_category(tracker).values())  # (DDP's buckets are the gradients it sees)
