"""Calls from this rank to the actors of another mesh, straight to their ranks' lanes (on this machine) or
links (on other hosts: `rank/far_calls.py`).

The first call to another mesh goes the long way (this rank's agent, the controller's bridge, the other
mesh's agent), and the controller then tells this rank where that mesh's ranks on this machine listen
(`DirectRoute`). Later calls go to those lanes directly and the replies come back on them: two transfers
where the bridge makes eight. Such a call names this process as its caller with a number no other
process uses (`direct_caller()`), so the callee's books of calls never mix it with another's. A lane
that cannot be opened (that mesh was restarted or stopped) sends the call the long way, where it is
answered as before; a lane that closes with calls in flight answers them with the rank's death.

A call to an async actor goes on that actor's own lane when it has one (`rank/actor_lanes.py`: its own
loop reads it, one thread switch fewer than the rank's lane), else on the rank's; all of this
process's calls to one actor take one lane, so they arrive in order. When that actor ends, its lane
is retired (`LaneRetired`): new calls take the rank's lane, and the retired one closes once it owes
no answer.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.rank.debugging import untraced
from monarch_kernel.rank.far_calls import FarLinks
from monarch_kernel.wire.calls import death_reply
from monarch_kernel.wire.lane_client import connect_lane
from monarch_kernel.wire.lanes import actor_lane_path, lane_path
from monarch_kernel.wire.messages import ActorCall, ActorReply, CancelCall, DirectRoute, LaneRetired
from monarch_kernel.wire.transport import BlockingConnection

DIRECT_CALLERS = -1_000_000  # caller ids below this are processes calling another mesh's lanes directly
FAR_FAN_OUT = 8  # calls to at most this many ranks of a mesh on other hosts take links; more go the long way
_HOST_BITS = secrets.randbits(40) << 22  # (pids fit in 22 bits: the same pid on two hosts still differs)


def direct_caller() -> int:
    """This process's caller id on other meshes' lanes and links (distinct from every rank number, the
    notebook's, and, w.h.p., any process's of another host)."""
    return DIRECT_CALLERS - (_HOST_BITS | os.getpid())


class LaneRetiredError(ConnectionClosed):
    """A call was not sent: its lane was retired (its actor ended); another lane takes it."""


class DirectLane:
    """This rank's lane to one rank of another mesh (or to one async actor there): calls out (any thread),
    replies in (its reader thread)."""

    def __init__(self, path: str, rank: int, deliver: Callable[[ActorReply], None]):
        self.rank = rank
        self.conn = BlockingConnection(connect_lane(path))
        self._deliver = deliver
        self._lock = threading.Lock()
        self._owed: set[int] = set()  # call ids sent and not answered
        self.closed = False
        self.retired = False  # its actor ended: no new calls here (it closes once it owes no answer)
        untraced(threading.Thread(target=self._read, name=f"direct-lane-{rank}", daemon=True)).start()

    def usable(self) -> bool:
        """Whether new calls may go on this lane."""
        return not (self.closed or self.retired)

    def owes(self, call_id: int) -> bool:
        """Whether a call of this id was sent here and not answered yet."""
        with self._lock:
            return call_id in self._owed

    def send(self, msg: ActorCall | CancelCall) -> None:
        """Send a call (or its cancel); raises ConnectionClosed if the lane is gone (LaneRetiredError: the call
        was not sent, it may take another lane)."""
        if isinstance(msg, ActorCall) and not msg.to_port:
            with self._lock:
                if self.retired:
                    raise LaneRetiredError("the lane was retired")
                if self.closed:
                    raise ConnectionClosed("the lane closed")
                self._owed.add(msg.call_id)
        try:
            self.conn.send(msg)
        except (ConnectionClosed, OSError) as exc:
            with self._lock:
                self._owed.discard(getattr(msg, "call_id", -1))
            raise ConnectionClosed(f"the lane to rank {self.rank} closed") from exc

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (ConnectionClosed, OSError):
                break
            if isinstance(msg, ActorReply) and not msg.to_port:
                with self._lock:
                    self._owed.discard(msg.call_id)
                    done = self.retired and not self._owed
                self._deliver(msg)
                if done:
                    break
            elif isinstance(msg, LaneRetired):
                with self._lock:
                    self.retired = True
                    if not self._owed:
                        break
        with self._lock:
            self.closed = True
            owed, self._owed = self._owed, set()
        self.conn.close()
        for call_id in owed:  # the rank went away (died, restarted, stopped) before answering
            self._deliver(death_reply(direct_caller(), call_id, self.rank, f"rank {self.rank} of the called mesh "
                                                                           "went away before answering"))


class DirectCalls:
    """The other meshes this rank calls directly: on this machine by their ranks' lanes, on other hosts
    by links to their ranks (`rank/far_calls.py`).

    A call takes the direct way only when no call of this rank to that mesh that went the long way is
    still unanswered, so that calls from one caller reach an actor in the order they were made; a cancel
    goes the way its call went.
    """

    def __init__(self, deliver: Callable[[ActorReply], None], mesh_name: str,
                 in_flight: Callable[[int], bool] = lambda call_id: False,
                 pending: Callable[[], Iterable[int]] = tuple):
        self._deliver = deliver
        self._mesh_name = mesh_name  # this rank's (the callee's replies then carry no shared-memory names)
        self._in_flight = in_flight  # whether this rank's call of that id is still unanswered
        self._pending = pending  # the ids of this rank's calls still unanswered
        self._routes: dict[str, tuple[str, frozenset[int]]] = {}  # mesh -> (its lanes' folder, its ranks here)
        self._lanes: dict[tuple[str, int, str], DirectLane] = {}  # (mesh, rank, actor or "": the rank's lane)
        self._no_lane: set[tuple[str, int, str]] = set()  # actors with no lane of their own (sync, or ended)
        self.far = FarLinks(deliver, direct_caller)  # to meshes on other hosts (its `loop` is the rank's)
        self._long_way: dict[str, set[int]] = {}  # mesh with a route -> ids of calls that went the long way
        self._lock = threading.Lock()

    def learn(self, msg: DirectRoute) -> None:
        """Where mesh `msg.mesh`'s ranks listen (the controller says, after a first call). Every call of
        this rank unanswered now may have gone the long way to that mesh: calls wait for them to go direct."""
        with self._lock:
            self._long_way.setdefault(msg.mesh, set()).update(self._pending())
            if not msg.far:
                self._routes[msg.mesh] = (msg.shm_dir, frozenset(msg.local))
        if msg.far:
            self.far.learn(msg)

    def went_long_way(self, msg: ActorCall, mesh: str | None = None) -> None:
        """A call to mesh `mesh` (default: msg.mesh) went through the agent: once that mesh has a route,
        later calls wait for its answer to go direct."""
        mesh = msg.mesh if mesh is None else mesh
        if msg.to_port or mesh not in self._long_way:
            return
        with self._lock:
            ids = self._long_way[mesh]
            ids.add(msg.call_id)
            if len(ids) > 64:
                ids.intersection_update({i for i in ids if self._in_flight(i)})

    def _long_way_clear(self, msg: ActorCall | CancelCall, mesh: str) -> bool:
        with self._lock:
            ids = self._long_way.get(mesh)
            if not ids:
                return True
            if isinstance(msg, CancelCall):
                return msg.call_id not in ids
            ids.intersection_update({i for i in ids if self._in_flight(i)})
            return not ids

    def send(self, msg: ActorCall | CancelCall, mesh: str | None = None) -> bool:
        """Send a call (or cancel) to the ranks of mesh `mesh` (default: msg.mesh) straight to them; False:
        not known or not reachable that way (the caller sends it the long way)."""
        mesh = msg.mesh if mesh is None else mesh
        if mesh not in self._long_way or (isinstance(msg, ActorCall) and msg.to_port):
            return False  # (no route; replies through a Port go the long way, which forwards them)
        far = self.far.knows(mesh)
        if far and len(msg.ranks) > FAR_FAN_OUT:
            return False  # (a broadcast to many ranks fans out per host the long way, not per rank here)
        lanes: list[Any] | None = self.far.lanes(mesh, msg.ranks) if far else self._local_lanes(msg, mesh)
        if lanes is None or not self._long_way_clear(msg, mesh):
            return False
        direct = dataclasses.replace(msg, caller=direct_caller(), mesh="")
        if isinstance(direct, ActorCall):
            direct = dataclasses.replace(direct, from_mesh=self._mesh_name)
        for lane in lanes:
            try:
                self._send_on(lane, direct, mesh)
            except ConnectionClosed:
                if isinstance(msg, ActorCall):  # (its reader answers what it owed)
                    self._deliver(death_reply(direct_caller(), msg.call_id, lane.rank,
                                              f"rank {lane.rank} of mesh {mesh!r} went away before answering"))
        return True

    def _send_on(self, lane: Any, msg: ActorCall | CancelCall, mesh: str) -> None:
        try:
            lane.send(msg)
        except LaneRetiredError:  # (its actor ended as this call chose its lane: the rank's lane takes it)
            route = self._routes.get(mesh)
            rank_lane = self._lane(mesh, route[0], lane.rank, "") if route is not None else None
            if rank_lane is None:
                raise
            rank_lane.send(msg)

    def _local_lanes(self, msg: ActorCall | CancelCall, mesh: str) -> list[DirectLane] | None:
        route = self._routes.get(mesh)
        if route is None or not route[1].issuperset(msg.ranks):
            return None
        lanes = [self._lane_for(msg, mesh, route[0], rank) for rank in msg.ranks]
        return None if any(lane is None for lane in lanes) else [lane for lane in lanes if lane is not None]

    def _lane_for(self, msg: ActorCall | CancelCall, mesh: str, folder: str, rank: int) -> DirectLane | None:
        """The lane `msg` takes to `rank`: a call, its actor's own lane if it has one; a cancel, its call's."""
        if isinstance(msg, CancelCall):
            with self._lock:
                candidates = [lane for (m, r, _), lane in self._lanes.items() if m == mesh and r == rank]
            owing = [lane for lane in candidates if lane.owes(msg.call_id)]
            return owing[0] if owing else self._lane(mesh, folder, rank, "")
        return self._lane(mesh, folder, rank, msg.actor) or self._lane(mesh, folder, rank, "")

    def _lane(self, mesh: str, folder: str, rank: int, actor: str) -> DirectLane | None:
        """The lane to `rank` of `mesh` (`actor`: to that async actor's own lane; None if it has none)."""
        key = (mesh, rank, actor)
        with self._lock:
            lane = self._lanes.get(key)
            if lane is not None and lane.usable():
                return lane
            if actor and (key in self._no_lane or (lane is not None and lane.retired)):
                self._lanes.pop(key, None)
                self._no_lane.add(key)  # (an actor's lane, once gone, never comes back: its key names one spawn)
                return None
            path = actor_lane_path(folder, rank, actor) if actor else lane_path(folder, rank)
            try:
                lane = self._lanes[key] = DirectLane(path, rank, self._deliver)
            except OSError:
                if actor:  # a sync actor (or one that ended): the rank's lane takes its calls
                    self._no_lane.add(key)
                else:  # that mesh is gone or was restarted elsewhere: the long way from now on
                    self._routes.pop(mesh, None)
                return None
            return lane
