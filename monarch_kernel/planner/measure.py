"""Measured on a live mesh's ranks (run there by the planner): their throughput, their links, the
memory they may use, and a layout's real steps (time and peak memory) for a trial."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.planner.apply import TrainingSpec, build_in_layout, rank_device
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.parallelize import Batch


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rank_figures() -> dict[str, float]:
    """This rank's fp32 matmul FLOP/s, its memory to use (free GPU memory, or a fair share of the
    host's available memory), and the all-reduce bandwidth of the whole group and of this host."""
    device = rank_device()
    n = 1024 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def matmul() -> None:
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    matmul()
    flops = 2 * n ** 3 / _timed(matmul, 5)
    small = torch.ones(16, device=device)
    op_overhead = _timed(lambda: [torch.add(small, small) for _ in range(200)], 3) / 200
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    replicated = distribute_tensor(small, init_device_mesh(device.type, (dist.get_world_size(),)), [Replicate()])
    dtensor_overhead = _timed(lambda: [torch.add(replicated, replicated) for _ in range(100)], 3) / 100
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _available_host_memory() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    figures = {"flops_fp32": flops, "memory": float(free), "op_overhead": op_overhead,
               "dtensor_overhead": max(0.0, dtensor_overhead - op_overhead)}
    figures["inter_host_bandwidth"], figures["latency"] = _all_reduce_bandwidth(None, device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = dist.get_world_size()
    if local < world:  # several hosts: this host's ranks alone as well
        groups = [dist.new_group(list(range(h * local, (h + 1) * local))) for h in range(world // local)]
        figures["intra_host_bandwidth"], _ = _all_reduce_bandwidth(groups[dist.get_rank() // local], device)
    else:
        figures["intra_host_bandwidth"] = figures["inter_host_bandwidth"]
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


def _all_reduce_bandwidth(group: Any, device: torch.device) -> tuple[float, float]:
    """Bus bandwidth of all_reduce in bytes/s (ring: 2(n-1)/n of the bytes cross each link), and the
    time of a tiny one (the latency every collective pays)."""
    size = dist.get_world_size(group)
    if size == 1:
        return float("inf"), 0.0
    best, latency = 0.0, 0.0
    for nbytes in (4, 1 << 20, 16 << 20):
        tensor = torch.ones(nbytes // 4, device=device)

        def reduce(tensor: torch.Tensor = tensor) -> None:
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        reduce()
        seconds = _timed(reduce, 5 if nbytes == 4 else 3)
        if nbytes == 4:
            latency = seconds
        else:
            best = max(best, 2 * (size - 1) / size * nbytes / max(seconds - latency, 1e-9))
    return best, latency


def trial_layout(spec: TrainingSpec, layout: Layout, batch: Batch, steps: int) -> dict[str, float]:
    """Build the layout for real, run `steps` steps (the first warms up), and measure on this rank:
    the median step time and the peak memory of a step (GPU: max_memory_allocated; CPU: torch's
    memory tracker around a real step, plus DDP's gradient buckets, which it cannot see)."""
    model, optimizer, step, _ = build_in_layout(spec, layout, batch)
    step(batch)  # warm-up: the optimizer's state is made here
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        times = [_timed(lambda: step(batch), 1) for _ in range(max(1, steps - 1))]
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        times = [_timed(lambda: step(batch), 1) for _ in range(max(1, steps - 2))]
        peak = float(_tracked_peak(model, optimizer, step, batch, layout))
    return {"step_seconds": statistics.median(times), "peak_bytes": peak}


def _tracked_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[Batch], float],
                  batch: Batch, layout: Layout) -> int:
    from monarch_kernel.planner.trackers import memory_tracker, peak_by_category

    plain = getattr(model, "module", model)  # (DDP's wrapper: track the model inside)
    tracker = memory_tracker(plain, optimizer, fsdp=layout.fsdp > 1)
    with tracker:
        step(batch)
    peak = sum(peak_by_category(tracker).values())
    if layout.ddp > 1 and layout.tp == 1 and layout.pp == 1:
        peak += sum(p.numel() * p.element_size() for p in plain.parameters() if p.requires_grad)  # DDP's buckets
    return peak
