"""What each actor of this process owns, stopped with it (Monarch's recursive stop).

An actor owns the actor meshes it spawns and the processes it starts (`HostMesh.spawn_procs` in an
endpoint or constructor). When the actor is stopped (its actor mesh's `stop()`, its processes'
`ProcMesh.stop()`, or a spawn of the same name replacing it), what it owns is stopped too, newest
first, after its own `__cleanup__`: the actor meshes (their `__cleanup__` runs, and whatever they own
goes the same way), then the processes (the notebook ends them, their actors' clean-up first).

Runs on ranks (`rank/actor_host.py` stops what a stopped actor owned); the notebook's own spawns
have no owner here (the notebook stops its meshes itself). Threads: any; `_lock` guards `_owned`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from monarch_kernel.core.errors import MeshNotRunningError, SupervisionError

_lock = threading.Lock()
_owned: dict[str, list[tuple[str, Callable[[], object]]]] = {}  # owner's spawn key -> (what, its stop), oldest first


def record(owner: str | None, what: str, stop: Callable[[], object]) -> None:
    """`owner` (an actor's spawn key; None: not an actor) spawned or started `what`, which `stop()` stops (a
    bounded wait: it runs while its owner is being stopped)."""
    if owner is None:
        return
    with _lock:
        _owned.setdefault(owner, []).append((what, stop))


def stop_owned(owner: str) -> None:
    """Stop what `owner` owns, newest first (once: it is forgotten here). A failure to stop one is printed, and
    the others are still stopped."""
    with _lock:
        owned = _owned.pop(owner, [])
    for what, stop in reversed(owned):
        try:
            stop()
        except (SupervisionError, MeshNotRunningError):
            pass  # its processes are gone (dead, or stopped): nothing of it is left to stop
        except Exception as exc:  # noqa: BLE001 - the rest must still stop
            print(f"stopping {what}, which a stopped actor owned, failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
