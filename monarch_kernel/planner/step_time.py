"""The time of one training step of a layout, modelled from its estimate: compute from FLOPs and
per-operator costs, communication per kind of collective from the links it runs on.

- Compute: the rank's FLOPs over its FLOP/s, plus each dispatched operator's overhead (more on
  DTensors). Through a pipeline, the slowest stage's micro-batches plus the 1F1B schedule's fill
  and drain: (micro-batches + stages - 1) / micro-batches of it.
- Communication: every collective pays its link's latency per call (per step of its ring, so
  more in larger groups), and its bytes at the link's bus bandwidth. Collectives of the
  tensor-parallel group (filed with the suffix `layout.TP`) run inside a host; data-parallel
  collectives cross hosts when the data-parallel group spans them; activations between pipeline
  stages cross hosts when the mesh has several. Nothing is assumed to overlap with compute.
"""

from __future__ import annotations

from typing import Any

from monarch_kernel.planner.hardware import Figures, collective_seconds
from monarch_kernel.planner.layout import TP, Layout


def compute_seconds(estimate: Any, layout: Layout, figures: Figures, flops_per_second: float) -> float:
    """The compute part of a step (see the module docstring)."""
    seconds = (estimate.flops / flops_per_second + estimate.ops * figures.op_overhead
               + estimate.dtensor_ops * figures.dtensor_overhead)
    if layout.pp > 1:
        seconds *= (estimate.microbatches + layout.pp - 1) / estimate.microbatches
    return seconds


def comm_seconds(estimate: Any, layout: Layout, figures: Figures, hosts: int, gpus: int) -> float:
    """The communication part of a step (see the module docstring)."""
    dp_across_hosts = layout.data_parallel > gpus if layout.pp > 1 else hosts > 1
    total = 0.0
    for kind, size in estimate.collectives.items():
        if kind == "recv":  # counted with its send: both directions at once
            continue
        calls = estimate.calls.get(kind, 0)
        if kind == "send":
            latency, bandwidth = figures.link("send_recv", hosts > 1, 2)
            total += calls * latency + collective_seconds("send_recv", size, 2, bandwidth)
            continue
        on_tp = kind.endswith(TP)
        base = kind.removesuffix(TP)
        group = layout.tp if on_tp else layout.data_parallel
        latency, bandwidth = figures.link(base, dp_across_hosts and not on_tp, group)
        total += calls * latency + collective_seconds(base, size, group, bandwidth)
    return total
