"""Where a mesh's ranks on remote hosts listen for calls from ranks of other hosts (`rank/far_calls.py`).

The first call that a rank makes to this mesh's actors on another host (from another mesh, or from
this one) goes through the controller (the bridge, or this mesh's router). If every rank of this mesh
runs on a remote host with a known address, the controller then asks for a route: the ranks are told
(once) to listen on their hosts' addresses under a key made for this mesh, and each caller that asked
is told where, once all of them listen. Ranks that cannot listen leave the mesh without routes: calls
go through the controller, as before. A restart forgets it all.
"""

from __future__ import annotations

from collections.abc import Callable

from monarch_kernel.controller.state import MeshState
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.relay_link import new_key

Tell = Callable[[m.DirectRoute], None]


class FarRoutes:
    """The routes to one mesh's ranks on remote hosts (loop thread)."""

    def __init__(self, state: MeshState):
        self._state = state
        self.reset()

    def reset(self) -> None:
        """The mesh restarted or ended: its ranks listen nowhere yet."""
        self._key = b""
        self._where: dict[int, tuple[str, int]] = {}  # rank -> (address, port) it listens at
        self._waiting: list[tuple[int, Tell]] = []  # (caller, how to tell it) until every rank listens
        self.failed = ""  # why the ranks could not listen ("" while they may)

    def route_for(self, caller: int, tell: Tell) -> bool:
        """Have `tell` receive the route for rank `caller` of another mesh: now, or once every rank of this
        mesh listens. False: this mesh has no such route (ranks on this machine, or they cannot listen)."""
        ranks = tuple(sorted(self._state.ranks))
        addresses = [self._address(rank) for rank in ranks]
        if self.failed or not ranks or not all(addresses):
            return False
        if len(self._where) == len(ranks):
            tell(self._route(caller))
            return True
        self._waiting.append((caller, tell))
        if not self._key:
            self._key = new_key()
            key = self._key
            self._state.send_to_ranks(ranks, lambda local: m.ListenForCalls(local, self._address(local[0]), key))
        return True

    def listening(self, msg: m.ListeningForCalls) -> None:
        """A rank says where it listens (or why it cannot)."""
        if not self._key or self.failed:
            return
        if not msg.port:
            self.failed = msg.error or f"rank {msg.rank} cannot listen for calls"
            self._waiting.clear()
            return
        self._where[msg.rank] = (msg.address, msg.port)
        if len(self._where) == len(self._state.ranks):
            waiting, self._waiting = self._waiting, []
            for caller, tell in waiting:
                tell(self._route(caller))

    def _route(self, caller: int) -> m.DirectRoute:
        far = tuple((rank, *self._where[rank]) for rank in sorted(self._where))
        return m.DirectRoute((caller,), self._state.name, "", tuple(sorted(self._where)), far=far, key=self._key)

    def _address(self, rank: int) -> str:
        """The address other hosts reach rank `rank`'s host at ("" on this machine, or not known)."""
        if self._state.shm_dir_for((rank,)) is not None:
            return ""
        link = self._state.link_of(rank)
        return link.host.address if link is not None and link.host is not None else ""

