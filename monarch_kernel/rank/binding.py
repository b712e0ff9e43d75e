"""Pinning a new rank to CPUs and NUMA memory (`spawn_procs(proc_bind=[...])`, as Monarch's).

Applied in the forked child before it starts any thread, so that every thread it will have inherits
it: what `numactl` (`cpunodebind`, `physcpubind`, `membind`) or `taskset -c` (`cpus`) would do to
a process they start, without those tools. On a NUMA host (one with /sys/devices/system/node/node0)
the numactl keys take precedence and `cpus` is used only when none is given; elsewhere `cpus` alone
applies, as in Monarch.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

from monarch_kernel.core.proc_bind import NUMACTL_KEYS, parse_cpu_list

NODES = Path("/sys/devices/system/node")
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}  # the syscall's number per machine
_MPOL_BIND = 2


class BindingError(Exception):
    """A binding that cannot be applied here (a CPU or NUMA node this host lacks)."""


def apply_binding(bind: dict[str, str]) -> None:
    """Pin the calling (single-threaded) process as `bind` says; BindingError says what this host lacks."""
    numa = (NODES / "node0").exists()
    cpus: set[int] | None = None
    if numa and "cpunodebind" in bind:
        cpus = set().union(*(_node_cpus(node) for node in sorted(parse_cpu_list(bind["cpunodebind"]))))
    if numa and "physcpubind" in bind:
        physical = parse_cpu_list(bind["physcpubind"])
        cpus = physical if cpus is None else cpus & physical
    if cpus is None and "cpus" in bind and not (numa and set(bind) & set(NUMACTL_KEYS)):
        cpus = parse_cpu_list(bind["cpus"])
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            raise BindingError(f"proc_bind {bind}: cannot pin to CPUs {sorted(cpus)} ({exc.strerror}); this host "
                               f"has CPUs {sorted(os.sched_getaffinity(0))}") from None
    if numa and "membind" in bind:
        _bind_memory(parse_cpu_list(bind["membind"]), bind)


def _node_cpus(node: int) -> set[int]:
    try:
        return parse_cpu_list((NODES / f"node{node}" / "cpulist").read_text())
    except FileNotFoundError:
        raise BindingError(f"proc_bind cpunodebind: this host has no NUMA node {node}") from None


def _bind_memory(nodes: set[int], bind: dict[str, str]) -> None:
    number = _SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise BindingError(f"proc_bind {bind}: membind is not supported on {platform.machine()} hosts")
    missing = [node for node in sorted(nodes) if not (NODES / f"node{node}").exists()]
    if missing:
        raise BindingError(f"proc_bind membind: this host has no NUMA node {missing[0]}")
    bits = max(nodes) + 1
    words = (bits + 63) // 64
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        mask[node // 64] |= 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _MPOL_BIND, mask, ctypes.c_ulong(bits + 1)) != 0:
        raise BindingError(f"proc_bind membind: set_mempolicy failed ({os.strerror(ctypes.get_errno())})")
