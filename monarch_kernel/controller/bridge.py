"""Calls between the actors of two meshes of one notebook (Monarch's proc meshes talking to each other).

Agents route by rank number, and each mesh numbers its ranks from 0, so a rank's call to
another mesh's actors (`ActorCall.mesh` set) goes up to its own mesh's controller side, which
hands it here. The bridge makes it a call of the notebook's on the other mesh: that mesh
answers it as it answers the notebook (a dead rank answers with its death), and each reply
goes back down to the caller as the reply to its own call. A cancel follows the call; the
messages of a Port go to the mesh of its owner. Both meshes run on the controller's one loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.supervision import Supervisors
from monarch_kernel.wire.calls import PORTS, CallTable, death_reply
from monarch_kernel.wire.messages import (
    CONTROLLER,
    ActorCall,
    ActorFailed,
    ActorReply,
    CancelCall,
    DirectRoute,
    FailureCause,
)
from monarch_kernel.wire.routing import CallRouter


class MeshSide(Protocol):
    """What the bridge needs of a mesh's controller side (`ControllerSender`)."""

    calls: CallTable
    router: CallRouter
    supervisors: Supervisors

    @property
    def mesh_name(self) -> str:
        """The mesh's name."""

    def shm_dir_for(self, ranks: Iterable[int]) -> str | None:
        """Its lanes' folder, if these of its ranks run on this machine."""

    def direct_route(self, to: int) -> DirectRoute | None:
        """Where its ranks listen, for rank `to` of another mesh on this machine (None: not all here)."""

    def far_route(self, caller: int, tell: Callable[[DirectRoute], None]) -> bool:
        """Have `tell` get where its ranks on remote hosts listen, for rank `caller` of another mesh."""

    def tell_rank(self, rank: int, msg: Any) -> None:
        """Send a message to one of its ranks."""


class MeshBridge:
    """The meshes of this notebook, and the calls between them in flight (loop thread, but `join`/`leave`)."""

    def __init__(self) -> None:
        self._meshes: dict[str, MeshSide] = {}
        # (caller's mesh, caller, call id) -> (the called mesh's side, the notebook's call id there)
        self._calls: dict[tuple[str, int, int], tuple[MeshSide, int]] = {}
        self._ports: dict[str, set[int]] = {}  # mesh -> ports forwarding replies of calls made to or from it
        self._told: set[tuple[str, int, str]] = set()  # (mesh, rank, other mesh): told to call it directly
        self.forwarded = 0  # calls it passed on (those that went direct are not seen here)

    def join(self, side: MeshSide) -> None:
        """A mesh started (a newer one of the same name replaces the older)."""
        self._meshes[side.mesh_name] = side

    def leave(self, side: MeshSide, closed: bool) -> None:
        """A mesh restarted (its calls failed) or shut down (`closed`): forget what forwards to or from it."""
        if closed and self._meshes.get(side.mesh_name) is side:
            del self._meshes[side.mesh_name]
        for port_id in self._ports.pop(side.mesh_name, ()):
            PORTS.close(port_id)
        for origin, (target, _) in list(self._calls.items()):
            if target is side or origin[0] == side.mesh_name:
                del self._calls[origin]
        self._told = {told for told in self._told if side.mesh_name not in (told[0], told[2])}
        for other in list(self._meshes.values()):
            if other is not side:
                other.supervisors.mesh_restarted(side.mesh_name)

    def rank_died(self, side: MeshSide, rank: int, why: str) -> None:
        """A rank of `side` died: owners of its actors in the other meshes hear of it (loop thread)."""
        for other in list(self._meshes.values()):
            if other is not side:
                other.supervisors.rank_died(rank, why, mesh=side.mesh_name)

    def actor_failed(self, side: MeshSide, msg: ActorFailed, heard: Callable[[], None]) -> bool:
        """An actor of `side` failed: its owner in another mesh hears of it (then heard()); False if none owns it
        (loop thread)."""
        return any(other.supervisors.actor_failed(msg, heard, mesh=side.mesh_name)
                   for other in list(self._meshes.values()) if other is not side)

    def call(self, source: MeshSide, msg: ActorCall) -> None:
        """A rank of `source` calls actors of mesh `msg.mesh`."""
        target = self._meshes.get(msg.mesh)
        if target is None:
            why = (f"mesh {msg.mesh!r} is not running in this notebook (it was stopped, or its processes "
                   "were started by another kernel)")
            for rank in msg.ranks:
                source.router.reply(death_reply(msg.caller, msg.call_id, rank, why, FailureCause.MESH_NOT_RUNNING,
                                                to_port=msg.to_port))
            return
        self.forwarded += 1
        back = self._back_to(source, msg.caller, msg.call_id)
        if msg.to_port:  # replies go through the caller's port, as many as the actors send
            port = PORTS.open_forwarding(back)
            for mesh in (source.mesh_name, target.mesh_name):
                self._ports.setdefault(mesh, set()).add(port.port_id)
            call_id = port.port_id
        else:
            origin = (source.mesh_name, msg.caller, msg.call_id)

            def replied(reply: ActorReply) -> None:
                back(reply)
                if pending.done():
                    self._calls.pop(origin, None)

            pending = target.calls.new(msg.ranks, f"{msg.endpoint} from mesh {source.mesh_name!r}", replied)
            self._calls[origin] = (target, pending.call_id)
            call_id = pending.call_id
        target.router.call(replace(msg, caller=CONTROLLER, call_id=call_id, mesh="", from_mesh=source.mesh_name))
        self._route_directly(source, target, msg.caller)

    def _route_directly(self, source: MeshSide, target: MeshSide, caller: int) -> None:
        """A rank calling another mesh may call its ranks itself from now on (rank/direct_calls.py): their
        lanes when both run on this machine, else links to them when they all run on remote hosts; told once."""
        told = (source.mesh_name, caller, target.mesh_name)
        if caller < 0 or told in self._told:
            return
        route = target.direct_route(caller) if source.shm_dir_for((caller,)) is not None else None
        if route is not None:
            self._told.add(told)
            source.tell_rank(caller, route)
        elif target.far_route(caller, lambda far: source.tell_rank(caller, far)):
            self._told.add(told)

    def cancel(self, source: MeshSide, msg: CancelCall) -> None:
        """A rank of `source` stops its call to another mesh."""
        found = self._calls.get((source.mesh_name, msg.caller, msg.call_id))
        if found is not None:
            target, call_id = found
            target.router.cancel(CancelCall(CONTROLLER, call_id, msg.ranks))

    def port_message(self, msg: ActorReply) -> None:
        """A message through a Port that a rank of mesh `msg.mesh` opened."""
        target = self._meshes.get(msg.mesh)
        if target is not None:  # (a port of a mesh that is gone takes nothing, as a closed port)
            target.router.reply(replace(msg, mesh=""))

    @staticmethod
    def _back_to(source: MeshSide, caller: int, call_id: int) -> Callable[[ActorReply], None]:
        """Sends a reply of the other mesh down to the caller, as the reply to its own call."""

        def back(reply: ActorReply) -> None:
            loop = ControllerLoop.get()
            answer = replace(reply, caller=caller, call_id=call_id)
            if threading.current_thread() is loop.thread:  # (a reply routed here: no extra turn of the loop)
                source.router.reply(answer)
            else:
                loop.call(source.router.reply, answer)

        return back


BRIDGE = MeshBridge()
