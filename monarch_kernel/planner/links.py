"""The mesh's own links, measured on its ranks (all of them at once, run by the planner): the
latency and bus bandwidth of all-reduce, all-gather, reduce-scatter and send/recv, among the
ranks of one host ("intra") and over the whole mesh ("inter", when it spans hosts).

Each kind is timed at a few sizes: the smallest gives the latency every call pays (in a ring,
one hop's latency per step: `hardware.ring_hops` scales it to groups of other sizes), the larger
ones the bandwidth (the best of them, as bus bandwidth: the bytes that cross each rank's link
in a ring, 2(n-1)/n of the buffer for all-reduce, (n-1)/n for the gathers and scatters, all of
it for send/recv). Send/recv pairs neighbouring ranks, both directions at once.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.planner.hardware import LINK_KINDS, bus_factor

SIZES = (4, 1 << 20, 8 << 20)  # bytes


def _operation(kind: str, group: Any, ranks: list[int], nbytes: int, device: torch.device) -> Callable[[], None]:
    size = len(ranks)
    count = max(size, nbytes // 4 // size * size)  # divisible by the ranks, for the scatter
    flat = torch.ones(count, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(flat, group=group)
    if kind == "all_gather":
        out = torch.empty(count * size, device=device)
        return lambda: dist.all_gather_single(out, flat, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(count // size, device=device)
        return lambda: dist.reduce_scatter_single(out, flat, group=group)
    me = ranks.index(dist.get_rank())
    peer = ranks[me ^ 1]
    inbox = torch.empty(count, device=device)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, flat, peer, group), dist.P2POp(dist.irecv, inbox, peer, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return exchange


def median_seconds(fn: Callable[[], Any], repeat: int, device: torch.device | None = None) -> float:
    """The median time of `repeat` calls (waiting for a GPU's queue to drain after each)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _measure(kind: str, group: Any, ranks: list[int], device: torch.device) -> list[float] | None:
    """[latency in seconds, bus bandwidth in bytes/s, ranks] of one kind over `group` (None: not measurable)."""
    if len(ranks) < 2 or (kind == "send_recv" and len(ranks) % 2):
        return None
    latency, best = 0.0, 0.0
    for nbytes in SIZES:
        operation = _operation(kind, group, ranks, nbytes, device)
        operation()  # warm-up: connections, buffers
        seconds = median_seconds(operation, 5 if nbytes == SIZES[0] else 3, device)
        if nbytes == SIZES[0]:
            latency = seconds
        else:
            moved = bus_factor(kind, len(ranks)) * nbytes
            best = max(best, moved / max(seconds - latency, 1e-9))
    return [latency, best, float(len(ranks))]


def measure_links(device: torch.device) -> dict[str, dict[str, list[float]]]:
    """{"intra": {kind: [latency, bandwidth, ranks]}, "inter": {...}} on this rank (every rank must call it)."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    hosts = max(1, world // local)
    host_groups = []
    for host in range(hosts):  # every rank makes every group, in the same order
        members = list(range(host * local, (host + 1) * local))
        host_groups.append((dist.new_group(members) if hosts > 1 else None, members))
    group, members = host_groups[dist.get_rank() // local]
    found: dict[str, dict[str, list[float]]] = {"intra": {}, "inter": {}}
    for kind in LINK_KINDS:
        _store(found["intra"], kind, _measure(kind, group, members, device))
    if hosts > 1:
        everyone = list(range(world))
        # send/recv across hosts: rank r of host h with rank r of the next host, hosts paired
        across = [h * local + dist.get_rank() % local for h in range(hosts)]
        pair_group = None
        for slot in range(local):  # groups of each slot's ranks across the hosts, made in the same order
            made = dist.new_group([h * local + slot for h in range(hosts)])
            if slot == dist.get_rank() % local:
                pair_group = made
        for kind in LINK_KINDS:
            if kind == "send_recv":
                _store(found["inter"], kind, _measure(kind, pair_group, across, device))
            else:
                _store(found["inter"], kind, _measure(kind, None, everyone, device))
    return found


def _store(into: dict[str, list[float]], kind: str, measured: list[float] | None) -> None:
    if measured is not None:
        into[kind] = measured
