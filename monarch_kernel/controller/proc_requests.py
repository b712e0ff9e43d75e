"""Processes that an actor starts itself (Monarch's `this_host().spawn_procs(...)` inside an endpoint).

A rank cannot start processes: the notebook does, as for its own `spawn_procs`, on the asking rank's
host and with its mesh's settings. The notebook side registers how (`serve_with`); the request runs
on a helper thread (a start takes seconds) and its answer goes back through the rank's port.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from monarch_kernel.controller.hostspec import HostSpec
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.state import MeshSpec
from monarch_kernel.core.shape import Shape
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.describe import describe_failure
from monarch_kernel.wire.routing import CallRouter
from monarch_kernel.wire.serialization import seal, unseal


class ProcStarter(Protocol):
    """What the notebook side does for an actor that starts or stops processes."""

    def start(self, like: MeshSpec, host: HostSpec, per_host: dict[str, int], name: str | None,
              options: dict[str, Any]) -> tuple[str, Shape]:
        """Start processes on `host`, with the settings of mesh `like`; the new mesh's name and shape."""

    def stop(self, mesh: str) -> None:
        """Stop a mesh that an actor started."""

    def controller(self, name: str, cls: type, args: tuple, kwargs: dict) -> Any:
        """The notebook's controller actor called `name` (spawned now if there is none); its ActorMesh."""


_starters: list[ProcStarter] = []


def serve_with(starter: ProcStarter) -> None:
    """How the notebook starts processes for actors (the api layer registers it)."""
    _starters[:] = [starter]


def handle(spec: MeshSpec, host: int, router: CallRouter, msg: m.ProcsRequest) -> None:
    """A rank of mesh `spec` on its host number `host` asks (loop thread): do it on a helper thread, answer
    through its port."""

    def work() -> None:
        value: Any = None
        failure = None
        try:
            if not _starters:
                raise RuntimeError("this kernel cannot start processes for actors (no notebook side)")
            if isinstance(msg.op, m.StartProcs):
                options = unseal(msg.op.options)
                value = _starters[0].start(spec, spec.hosts[host], dict(msg.op.per_host), msg.op.name or None, options)
            elif isinstance(msg.op, m.GetController):
                cls, args, kwargs = unseal(msg.op.actor)
                value = _starters[0].controller(msg.op.name, cls, args, kwargs)
            else:
                _starters[0].stop(msg.op.mesh)
        except BaseException as exc:  # noqa: BLE001 - the asking endpoint raises it
            failure = describe_failure(exc)
        owner, port_id = msg.reply_to
        answer = m.ActorReply(owner, port_id, m.CONTROLLER, None if failure else seal(value), failure, to_port=True)
        ControllerLoop.get().call(router.reply, answer)

    threading.Thread(target=work, name="actor-spawn-procs", daemon=True).start()

