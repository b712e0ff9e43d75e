"""Processes that actors start themselves: the notebook side of controller/proc_requests.py.

An endpoint's `this_host().spawn_procs(...)` (as Monarch allows) reaches the notebook, which starts
the processes on the asking rank's host with its mesh's settings, as `mesh.host_mesh()` would; the
new meshes show in `%mesh status` like the notebook's own, and end with the notebook.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from monarch_kernel.actors.client import ActorMesh
from monarch_kernel.actors.procs import HostMesh, ProcMesh
from monarch_kernel.api.mesh import start_like
from monarch_kernel.api.this_host import stop_started_here, this_proc
from monarch_kernel.controller import proc_requests
from monarch_kernel.controller.hostspec import HostSpec
from monarch_kernel.controller.state import MeshSpec
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.shape import Shape
from monarch_kernel.wire.calls import find_sender


class ActorProcesses:
    """Starts and stops processes for actors (see the module's note)."""

    def __init__(self) -> None:
        self._started: dict[str, ProcMesh] = {}
        self._lock = threading.Lock()
        self._controllers: dict[str, ActorMesh] = {}
        self._controllers_lock = threading.Lock()  # (held across a spawn: one spawn per name)

    def start(self, like: MeshSpec, host: HostSpec, per_host: dict[str, int], name: str | None,
              options: dict[str, Any]) -> tuple[str, Shape]:
        """Start the processes; the new mesh's name and shape."""
        procs = HostMesh([host], Shape((), (0,)), functools.partial(start_like, like)).spawn_procs(
            per_host=per_host, name=name, **options)
        with self._lock:
            self._started[procs.mesh_name] = procs
        return procs.mesh_name, procs.shape

    def stop(self, mesh: str) -> None:
        """Stop processes an actor started (others are the notebook's to stop)."""
        with self._lock:
            procs = self._started.pop(mesh, None)
        if procs is None:
            raise MeshUsageError(f"mesh {mesh!r} was not started by an actor (or is stopped already)")
        procs.stop()

    def controller(self, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
        """Monarch's get_or_spawn_controller: the one actor called `name`, spawned on this_proc() the first time
        (from the notebook or any actor); later asks get the same, whatever class or arguments they pass."""
        with self._controllers_lock:
            found = self._controllers.get(name)
            if found is not None and not _gone(found):
                return found
            actors = this_proc().spawn(name, cls, *args, **kwargs)
            self._controllers[name] = actors
            return actors

    def forget_controllers(self) -> None:
        """The processes they ran on were stopped (shutdown_context)."""
        with self._controllers_lock:
            self._controllers.clear()


def shutdown_local() -> int:
    """Monarch's shutdown_context() in the notebook: the processes this_host().spawn_procs and this_proc()
    started end (their actors' clean-up first), and the controllers on them are forgotten; how many meshes
    ended. The kernel goes on."""
    ACTOR_PROCESSES.forget_controllers()
    return stop_started_here()


def _gone(actors: ActorMesh) -> bool:
    return find_sender(actors.mesh_name) is None


ACTOR_PROCESSES = ActorProcesses()
proc_requests.serve_with(ACTOR_PROCESSES)
