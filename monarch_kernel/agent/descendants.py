"""Everything the ranks of a host start, kept within reach of its agent.

A rank's process group is not enough: a helper a cell starts in a session of its own
(`subprocess.Popen(..., start_new_session=True)`, a daemon that double-forks) leaves the group,
and once the rank dies it is re-parented to init and outlives the mesh. The agent makes itself
a *child subreaper* (`PR_SET_CHILD_SUBREAPER`): orphans below it are re-parented to it instead,
so every process the ranks start stays its descendant, and it kills them all before it exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Have orphaned descendants re-parented to this process (Linux 3.4+); whether it worked."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process we can see."""
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) >= 2:
            table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root: int | None = None, *, running_only: bool = False) -> list[int]:
    """Every process below `root` (this process by default), parents before children
    (running_only: leave out zombies, which have exited and only wait to be reaped)."""
    root = os.getpid() if root is None else root
    table = _parents()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if not (running_only and table[pid][1] == "Z"):
            found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def reap_adopted(keep: Iterable[int] = ()) -> list[int]:
    """Reap children that exited and are not ours to reap elsewhere (`keep`: the ranks, whose
    status their pidfd reports); orphans re-parented to a subreaper become its zombies."""
    me, kept, reaped = os.getpid(), set(keep), []
    for pid, (parent, state) in _parents().items():
        if parent == me and state == "Z" and pid not in kept:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
    return reaped


def kill_descendants(keep: Iterable[int] = (), timeout: float = 3.0) -> int:
    """SIGKILL every descendant of this process and reap the children among them, until none is
    left or `timeout` passes; how many there were. `keep`: children reaped elsewhere (the ranks)."""
    kept, seen = set(keep), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in descendants(running_only=True) if pid not in kept]
        reap_adopted(kept)
        if not alive:
            break
        for pid in alive:
            seen.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        reap_adopted(kept)
        time.sleep(0.01)
    return len(seen)
