"""Actor calls made from the notebook, and calls between ranks that pass through the controller.

`ControllerSender` is the CallSender that actor meshes in the notebook's process use.
Calls to ranks on this machine go straight down each rank's direct lane from the calling
thread, and the waiting thread reads the replies itself; calls to ranks on other hosts,
and calls between ranks of different hosts, go through the controller loop and the host
agents (on the loop thread), routed by a `CallRouter`. A rank that dies fails every call
still owed by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

from monarch_kernel.controller.bridge import BRIDGE
from monarch_kernel.controller.far_routes import FarRoutes
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.state import MeshState
from monarch_kernel.controller.supervision import Supervisors
from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.core.interrupt_shield import shielded
from monarch_kernel.core.supervision import MeshFailure
from monarch_kernel.core.timing import RankTiming, TimingReporter
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.calls import CallTable, PendingCall, death_reply, poll_until
from monarch_kernel.wire.lane_client import Lane, LanePool
from monarch_kernel.wire.routing import CallRouter, Send
from monarch_kernel.wire.transport import encode

WATCH_STEP_S = 0.5  # how often a wait on an actor call lets its hang watch look


class CallWatcher(Protocol):
    """Looks at an actor call's ranks while the notebook waits on it (api/hangs.CallWatch)."""

    def tick(self) -> None:
        """Between waits: look (now and then), show a verdict."""

    def close(self) -> None:
        """The wait ended."""


class ControllerSender:
    """Routes the actor calls of one mesh for the notebook's process (thread-safe entry points)."""

    caller_id = m.CONTROLLER
    own_rank = None  # the notebook is no rank

    def __init__(self, state: MeshState, loop: ControllerLoop, report_timing: TimingReporter | None = None):
        self._state = state
        self._loop = loop
        self._report_timing = report_timing
        self.calls = CallTable()  # calls made from this process
        self.router = CallRouter(next_hop=self._hop, serves=lambda rank: rank in state.ranks,
                                 why_dead=self._why_dead, deliver_here=self.calls.deliver, here_id=m.CONTROLLER)
        self.lanes = LanePool(state.shm_dir, loop.loop, self._on_lane_message)
        self._watchers: list[tuple[frozenset[int], Callable[[int, str], None]]] = []
        self._actor_watchers: list[tuple[str, Callable[[MeshFailure], None]]] = []  # (spawn key, callback)
        self.supervisors = Supervisors(self.calls, self.send_call, state.is_alive)  # actor meshes actors own
        self.far = FarRoutes(state)  # where its ranks on remote hosts listen for calls from other hosts
        self._told_own: set[int] = set()  # its ranks told where the others listen
        self.relayed_calls = 0  # calls between its ranks that came through here (not those on links)
        self.on_request_message: Callable[[Any], None] | None = None  # set by the RequestBook
        self.regrouper: Callable[[dict[int, str]], str | None] | None = None  # set by the notebook's Mesh
        self.call_watcher: Callable[[PendingCall], CallWatcher | None] | None = None  # (likewise: hangs)
        BRIDGE.join(self)  # (calls from other meshes' actors)

    @property
    def mesh_name(self) -> str:
        """The mesh's name."""
        return self._state.name

    def other_mesh(self, mesh_name: str) -> bool:
        """The notebook has one sender per mesh: none of them is another mesh's."""
        return False

    def _hop(self, rank: int) -> Send | None:
        link = self._state.link_of(rank)
        if link is None or not link.is_open or not self._state.is_alive(rank):
            return None
        return link.send

    def _why_dead(self, rank: int) -> str:
        state = self._state.ranks[rank]
        return self._state.death_failure(state, "is dead").message

    # ------------------------------------------------------------ from any thread
    def send_call(self, msg: m.ActorCall) -> None:
        """Send an actor call: local ranks over their lanes, the rest via the loop and agents (one step that
        a stop does not split: a call never goes to some of its ranks only)."""
        self._state.require_open()
        shielded(lambda: self._send_call(msg))

    def _send_call(self, msg: m.ActorCall) -> None:
        away = []
        chunks = None
        lanes = [(rank, self._lane(rank)) for rank in msg.ranks]
        for rank, lane in lanes:  # a rank that reads nothing: fail fast, before anything is sent
            if lane is not None:
                lane.check_room(rank)
        for rank, lane in lanes:
            if lane is None:
                away.append(rank)
                continue
            if chunks is None:
                chunks = encode(msg)
            try:
                self.lanes.send(lane, chunks)
            except ConnectionClosed:
                away.append(rank)  # the rank is going away: the agent reports how
        if away:
            self._loop.call(self.router.call, msg if len(away) == len(msg.ranks) else replace(msg, ranks=tuple(away)))

    def _lane(self, rank: int) -> Lane | None:
        if not self._state.is_alive(rank) or self._state.shm_dir_for((rank,)) is None:
            return None
        return self.lanes.get(rank)

    def request_lanes(self, ranks: frozenset[int]) -> list[Lane] | None:
        """The lanes to send a request to these ranks on: all on this machine and alive, each
        with an open lane; None otherwise (the request then goes through the agents)."""
        if not ranks or self._state.shm_dir_for(ranks) is None:
            return None
        lanes = []
        for rank in sorted(ranks):
            lane = self.lanes.get(rank) if self._state.is_alive(rank) else None
            if lane is None:
                return None
            lanes.append(lane)
        return lanes

    def _on_lane_message(self, msg: Any) -> None:
        if isinstance(msg, m.ActorReply):
            self.calls.deliver(msg)
        elif self.on_request_message is not None:
            self.on_request_message(msg)  # a request's output or result (RequestBook)

    def regroup(self, aborted: dict[int, str]) -> str | None:
        """Every rank makes a fresh default group, after a stopped call ended collectives (see CallSender)."""
        return None if self.regrouper is None else self.regrouper(aborted)

    def flush_calls(self) -> None:
        """Write calls queued on direct lanes now (a caller is about to wait)."""
        self.lanes.flush()

    def wait_for_replies(self, pending: PendingCall, count: int, timeout: float | None) -> bool:
        """Block until `count` replies are in; local replies are read on this thread. A call that runs
        past the mesh's hang limit is looked at between waits (the verdict shows while it hangs)."""
        self.lanes.flush()
        watch: CallWatcher | None = None  # (made once the first step passed: most calls end well before)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                step = WATCH_STEP_S if self.call_watcher is not None else timeout
                if deadline is not None:
                    step = min(step if step is not None else deadline, max(0.0, deadline - time.monotonic()))
                done = self.lanes.wait(pending.outstanding, lambda: len(pending.replies) >= count, step)
                if (pending.wait(count, step) if done is None else done):
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                if watch is None and self.call_watcher is not None:
                    watch = self.call_watcher(pending)
                if watch is not None:
                    watch.tick()
        finally:
            if watch is not None:
                watch.close()

    def send_cancel(self, msg: m.CancelCall) -> None:
        """Ask the ranks of a call to stop it."""
        if not self._state.closed:
            self._loop.call(self.router.cancel, msg)

    def send_port(self, msg: m.ActorReply) -> None:
        """Send a message through a Port that a rank opened."""
        self._state.require_open()
        self._loop.call(self.router.reply, msg)

    def send_up(self, msg: m.ForSupervisors) -> None:
        """Actors live on ranks: the notebook never owns an actor mesh through one of its actors."""
        raise RuntimeError("send_up is for ranks: the notebook has no actors")

    def answer(self, caller: int, call_id: int, value: Any, failure: m.Failure | None) -> bool:
        """No call is ever made to the notebook, so none waits for an answer here."""
        return False

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Poll ready() until it holds or the timeout passes (ports in the notebook wait on their own)."""
        return poll_until(ready, timeout)

    def shm_dir_for(self, ranks: Iterable[int]) -> str | None:
        """The shared-memory folder, if every one of these ranks runs on this machine."""
        return self._state.shm_dir_for(ranks)

    def direct_route(self, to: int) -> m.DirectRoute | None:
        """Where this mesh's ranks listen, for rank `to` of another mesh on this machine (None: not all here)."""
        ranks = tuple(sorted(self._state.ranks))
        folder = self._state.shm_dir_for(ranks)
        return m.DirectRoute((to,), self.mesh_name, folder, ranks) if folder else None

    def far_route(self, caller: int, tell: Callable[[m.DirectRoute], None]) -> bool:
        """Have `tell` get where this mesh's ranks on remote hosts listen, for rank `caller` of another mesh
        (now or once they listen); False if they are not all on remote hosts or cannot listen."""
        return self.far.route_for(caller, tell)

    def tell_rank(self, rank: int, msg: Any) -> None:
        """Send a message to one of this mesh's ranks through its agent (loop thread)."""
        self._state.send_to_ranks((rank,), lambda local: msg)

    def host_of(self, rank: int) -> str:
        """The host a rank runs on."""
        return self._state.host_of(rank)

    def is_alive(self, rank: int) -> bool:
        """Whether a rank is running (as last reported)."""
        return self._state.is_alive(rank)

    def watch_failures(self, ranks: Iterable[int], callback: Callable[[int, str], None]) -> None:
        """Call callback(rank, why) (on a helper thread) when one of these ranks dies."""
        self._watchers.append((frozenset(ranks), callback))

    def watch_actor_failures(self, key: str, callback: Callable[[MeshFailure], None]) -> None:
        """Call callback(failure) (on a helper thread) when an actor of spawn `key` fails (not when its rank dies:
        `watch_failures`)."""
        self._actor_watchers.append((key, callback))

    def record_timing(self, label: str, title: str, times: list[RankTiming]) -> None:
        """Keep per-rank durations of an actor call in the mesh's history, and show them."""
        self._state.record_timing(label, times)
        if self._report_timing is not None:
            self._report_timing(title, times)

    # ------------------------------------------------------------ on the loop thread
    def call_from_agents(self, msg: m.ActorCall) -> None:
        """A rank's call, to this mesh's actors or (`msg.mesh`) another mesh's. A rank calling ranks of
        this mesh on another host (its agent sent it up) may call them on links from now on, where they
        can listen (`far_routes`); told once."""
        if msg.mesh:
            BRIDGE.call(self, msg)
            return
        self.router.call(msg)
        self.relayed_calls += 1
        if msg.caller >= 0 and msg.caller not in self._told_own:
            self._told_own.add(msg.caller)
            self.far.route_for(msg.caller, lambda route: self.tell_rank(msg.caller, route))

    def cancel_from_agents(self, msg: m.CancelCall) -> None:
        """A rank stops a call it made."""
        if msg.mesh:
            BRIDGE.cancel(self, msg)
        else:
            self.router.cancel(msg)

    def reply_from_agents(self, msg: m.ActorReply) -> None:
        """A rank's answer, or a message through a Port (of another mesh's rank: `msg.mesh`)."""
        if msg.mesh:
            BRIDGE.port_message(msg)
        else:
            self.router.reply(msg, owed=True)

    def rank_died(self, rank: int, why: str) -> None:
        """Fail every call owed by a dead rank, and tell whoever watches it."""
        self.calls.fail_rank(rank, why)  # calls sent over its direct lane
        self.router.rank_died(rank, why)
        self.supervisors.rank_died(rank, why)
        BRIDGE.rank_died(self, rank, why)
        for ranks, callback in self._watchers:
            if rank in ranks:
                threading.Thread(target=callback, args=(rank, why), name="mesh-supervision", daemon=True).start()

    def own_actors(self, msg: m.OwnActors) -> None:
        """An actor of this mesh spawned an actor mesh: note who owns it, then tell the spawning rank (its spawn
        returns once told, so the new actors' failures always find their owner)."""
        self.supervisors.own(msg)
        if msg.known is not None:
            owner, port_id = msg.known
            self.router.reply(m.ActorReply(owner, port_id, m.CONTROLLER, None, None, to_port=True))

    def actor_failed(self, msg: m.ActorFailed) -> None:
        """An actor of this mesh failed: its owner hears of it, an actor (here or in another mesh) or the notebook;
        then its rank is told so (it answers the call that failed)."""
        def heard() -> None:
            if msg.heard is not None:
                owner, port_id = msg.heard
                self._loop.call(self.router.reply, m.ActorReply(owner, port_id, m.CONTROLLER, None, None, to_port=True))

        if self.supervisors.actor_failed(msg, heard) or BRIDGE.actor_failed(self, msg, heard):
            return
        heard()
        for key, callback in self._actor_watchers:
            if key == msg.key:
                threading.Thread(target=callback, args=(msg.failure,), name="mesh-supervision", daemon=True).start()

    def fail_all(self, why: str) -> None:
        """The mesh restarted or shut down: every call in flight fails."""
        self.lanes.close()
        self.far.reset()
        self._told_own.clear()
        for call in self.calls.pending():
            for rank in call.outstanding:
                self.calls.deliver(death_reply(m.CONTROLLER, call.call_id, rank, why, m.FailureCause.MESH_RESTARTED))
        self.router.forget()
        self.supervisors.forget()
        BRIDGE.leave(self, closed=self._state.closed)
