"""`spawn_procs(proc_bind=[...])`: what a binding may say (Monarch's keys), checked before processes start.

Each process of a host gets one dict: `cpunodebind`, `membind` or `physcpubind` (numactl's) and
`cpus` (taskset's), each a kernel CPU or node list such as "0-3,8". rank/binding.py applies them.
"""

from __future__ import annotations

BIND_KEYS = ("cpunodebind", "membind", "physcpubind", "cpus")
NUMACTL_KEYS = ("cpunodebind", "membind", "physcpubind")


def parse_cpu_list(text: str) -> set[int]:
    """The numbers of a kernel CPU or node list ("0-3,8,10-11"); ValueError if it is not one."""
    numbers: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{text!r} is not a list of numbers and ranges such as '0-3,8'")
        numbers.update(range(int(low), int(high or low) + 1))
    return numbers


def check_bindings(bindings: object, procs_per_host: int) -> tuple[tuple[tuple[str, str], ...], ...]:
    """proc_bind as given to spawn_procs, checked (ValueError says what to change): one dict per process of a
    host, in order; as the tuples that travel to the hosts."""
    if not isinstance(bindings, (list, tuple)):
        raise ValueError(f"proc_bind={bindings!r}: give a list of dicts, one per process of a host")
    if len(bindings) != procs_per_host:
        raise ValueError(f"proc_bind length ({len(bindings)}) must equal procs_per_host ({procs_per_host})")
    checked = []
    for bind in bindings:
        if not isinstance(bind, dict):
            raise ValueError(f"proc_bind entry {bind!r}: give a dict such as {{'cpus': '0-3'}}")
        unknown = set(bind) - set(BIND_KEYS)
        if unknown:
            raise ValueError(f"proc_bind keys {sorted(unknown)} are not binding keys; use {', '.join(BIND_KEYS)}")
        for key, value in bind.items():
            if not isinstance(value, str):
                raise ValueError(f"proc_bind {key}={value!r}: give a string, e.g. {{'{key}': '0'}}")
            parse_cpu_list(value)
        checked.append(tuple(sorted(bind.items())))
    return tuple(checked)
