"""What a Monarch program imports from `monarch.actor`, with Monarch's behaviour.

>>> from monarch_kernel.monarch.actor import Actor, endpoint, this_host, current_rank
>>> class Counter(Actor):
...     def __init__(self, start: int):
...         self.value = start
...     @endpoint
...     def incr(self) -> None:
...         self.value += 1
...     @endpoint
...     def get(self) -> int:
...         return self.value
>>> procs = this_host().spawn_procs(per_host={"gpus": 4})
>>> counters = procs.spawn("counters", Counter, 0)
>>> counters.incr.broadcast()
>>> counters.get.call().get()          # ValueMesh({gpus: 4}) of 1s
>>> procs.stop().get()

The same module works on ranks (in endpoints): `this_proc()` is then the rank's own
process, and ProcMesh handles passed in can be spawned on. Only the notebook starts and
stops processes. Set `unhandled_fault_hook` to decide what happens to actor mesh failures
that no actor's `__supervise__` handled (the default, as Monarch's, ends a program: its main thread
gets a KeyboardInterrupt and it exits the normal way; in a notebook it prints a report instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from monarch_kernel.actors import log_prefix as config  # Monarch's monarch.actor.config
from monarch_kernel.actors.base import Actor, concurrent_endpoint, current_rank, current_size, endpoint
from monarch_kernel.actors.client import ActorMesh
from monarch_kernel.actors.context import (
    Context,
    Instance,
    client_context,
    client_proc_from,
    context,
    current_actor_name,
)
from monarch_kernel.actors.helpers import Accumulator, send
from monarch_kernel.actors.log_prefix import install as install_log_prefix
from monarch_kernel.actors.ports import Channel, Port, PortReceiver
from monarch_kernel.actors.procs import (
    HostMesh,
    ProcMesh,
    controller_from_rank,
    proc_mesh_spawned,
    this_host_of_rank,
    this_proc_of_rank,
)
from monarch_kernel.core.bootstrap_command import BootstrapCommand, default_bootstrap_cmd
from monarch_kernel.core.errors import ActorError, SupervisionError
from monarch_kernel.core.future import DoneFuture, Future
from monarch_kernel.core.shape import Extent, Point
from monarch_kernel.core.supervision import MeshFailure, default_fault_hook, read_fault_hook_from
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.wire.calls import find_sender

__all__ = [
    "config",
    "Accumulator",
    "Actor",
    "ActorError",
    "BootstrapCommand",
    "ActorMesh",
    "Channel",
    "Context",
    "Extent",
    "Future",
    "HostMesh",
    "Instance",
    "MeshFailure",
    "Point",
    "Port",
    "PortReceiver",
    "ProcMesh",
    "SupervisionError",
    "ValueMesh",
    "attach_to_workers",
    "concurrent_endpoint",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "default_bootstrap_cmd",
    "endpoint",
    "get_or_spawn_controller",
    "register_proc_mesh_spawn_callback",
    "run_worker_loop_forever",
    "send",
    "shutdown_context",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
    "unregister_proc_mesh_spawn_callback",
]

# What the notebook does with an actor mesh failure that no actor handled; a program may
# replace it (monarch_kernel.monarch.actor.unhandled_fault_hook = my_hook), as in Monarch.
unhandled_fault_hook = default_fault_hook
read_fault_hook_from(lambda: unhandled_fault_hook)  # read at each failure: a program's assignment counts


def _on_rank() -> bool:
    sender = find_sender("")
    return sender is not None and sender.own_rank is not None


def this_host() -> HostMesh:
    """The notebook's machine as a HostMesh: `this_host().spawn_procs(per_host={"gpus": 4})`; in an actor,
    the actor's own host (the notebook starts the processes, with the actor's mesh's settings)."""
    if _on_rank():  # an actor's own host: the notebook starts what it spawns there
        return this_host_of_rank()
    from monarch_kernel.api import this_host as notebook  # noqa: PLC0415 - notebook side only

    return notebook.this_host()


def this_proc() -> ProcMesh:
    """The process running this code: in an endpoint, the actor's rank; in the notebook, a
    one-rank local mesh started on first use (Monarch's is the client process itself)."""
    if _on_rank():
        return this_proc_of_rank()
    from monarch_kernel.api import this_host as notebook  # noqa: PLC0415 - notebook side only

    return notebook.this_proc()


client_proc_from(this_proc)
_client_context = client_context  # Monarch's name for it (its tests watch context() use it, nothing kept per thread)
install_log_prefix(client=not _on_rank())  # Monarch's "[actor=...] " before log messages (in the client: <root>)

A = TypeVar("A", bound=Actor)


def get_or_spawn_controller(name: str, actor_class: type[A], *args: Any, **kwargs: Any) -> Future[ActorMesh]:
    """The one actor called `name` for the whole program: spawned (with these arguments) on the notebook's
    own process the first time it is asked for, from the notebook or from any actor's endpoint; every later
    ask gets the same actor, whatever it passes. `.get()` (or await) it, as in Monarch."""
    if _on_rank():
        return controller_from_rank(name, actor_class, args, kwargs)
    from monarch_kernel.api.actor_procs import ACTOR_PROCESSES  # noqa: PLC0415 - notebook side only

    return DoneFuture(ACTOR_PROCESSES.controller(name, actor_class, args, kwargs))


def register_proc_mesh_spawn_callback(callback: Callable[[ProcMesh], None]) -> None:
    """Have `callback(procs)` called with every ProcMesh that `spawn_procs` returns from now on (before it
    returns), as Monarch's: for monitoring or telemetry. An exception it raises comes out of that spawn_procs."""
    proc_mesh_spawned.append(callback)


def unregister_proc_mesh_spawn_callback(callback: Callable[[ProcMesh], None]) -> None:
    """Stop calling a callback given to register_proc_mesh_spawn_callback (ValueError if it was not given)."""
    proc_mesh_spawned.remove(callback)


def _check_ca(ca: str | None, private_key: object) -> None:
    if private_key is not None or ca not in (None, "trust_all_connections"):
        raise NotImplementedError("TLS certificates are not used here: workers admit clients with the user's worker "
                                  "key over an encrypted link (monarch_kernel/core/worker_key.py); pass "
                                  "ca='trust_all_connections'")


def run_worker_loop_forever(*, address: str, ca: str | None = None, private_key: object = None) -> None:
    """Make this process a host's worker, as Monarch's: it waits at `address` (`ipc://PATH`, `tcp://HOST:PORT`,
    `tcp://HOST:fdN`, `DIAL@BIND`) and starts a host agent for each client that attaches, until stopped. Clients
    must be this user's: on the same machine (ipc), or holding the user's worker key (tcp; see agent/worker.py)."""
    _check_ca(ca, private_key)
    from monarch_kernel.agent.worker import run_worker  # noqa: PLC0415 - a worker's process only

    run_worker(address)


def attach_to_workers(*, workers: Sequence[str | Future[str]], ca: str | None = None, private_key: object = None,
                      name: str | None = None) -> HostMesh:
    """A HostMesh {hosts: N} over workers started with run_worker_loop_forever (addresses, or futures of them), as
    Monarch's: `spawn_procs` starts processes there; `await hosts.initialized` raises if a worker does not answer."""
    _check_ca(ca, private_key)
    from monarch_kernel.api.workers import attach_to_workers as attach  # noqa: PLC0415 - notebook side only

    return attach(workers, name)


_shut_down = False


def shutdown_context(host_timeout: float | None = None) -> Future[None]:
    """Monarch's end of a program: stop every process this program started with `this_host().spawn_procs`
    and `this_proc()` (their actors' `__cleanup__` run first), and the controllers on them. Later calls do
    nothing, as in Monarch. Unlike Monarch's, the notebook kernel goes on: meshes started with `%mesh up`
    are not touched, and a later spawn_procs starts new processes. In an actor it does nothing."""
    global _shut_down
    if not _on_rank() and not _shut_down:
        _shut_down = True
        from monarch_kernel.api.actor_procs import shutdown_local  # noqa: PLC0415 - notebook side only

        shutdown_local()
    return DoneFuture(None)
