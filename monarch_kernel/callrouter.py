"""Actor calls made from the notebook, and calls between ranks that pass through the controller.

`ControllerSender` is the CallSender that actor meshes in the notebook's process use.
Calls to ranks on this machine go straight down each rank's direct lane from the calling
thread, and the waiting thread reads the replies itself; calls to ranks on other hosts,
and calls between ranks of different hosts, go through the controller loop and the host
agents (on the loop thread). A rank that dies fails every call still owed by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import messages as m
from .calls import CallTable, CallTracker, PendingCall, death_reply
from .lanes import Lane, LanePool
from .runstate import TimingRecord
from .transport import ConnectionClosed, encode

if TYPE_CHECKING:
    from .controller import MeshRuntime


class ControllerSender:
    """Routes the actor calls of one mesh for the notebook's process (thread-safe entry points)."""

    caller_id = m.CONTROLLER

    def __init__(self, runtime: MeshRuntime):
        self._runtime = runtime
        self.calls = CallTable()  # calls made from this process
        self.routed = CallTracker()  # calls between ranks routed through here
        self.lanes = LanePool(runtime.shm_dir, runtime.controller.loop, self._on_lane_message)
        self._watchers: list[tuple[frozenset[int], Callable[[int, str], None]]] = []

    @property
    def shm_dir(self) -> str:
        """The mesh's private shared-memory folder."""
        return self._runtime.shm_dir

    def shm_dir_for(self, ranks: Iterable[int]) -> str | None:
        """The shared-memory folder, if every one of these ranks runs on this machine."""
        return self._runtime.shm_dir_for(ranks)

    # ------------------------------------------------------------ from any thread
    def send_call(self, msg: m.ActorCall) -> None:
        """Send an actor call: local ranks over their lanes, the rest via the loop and agents."""
        runtime = self._runtime
        runtime.require_open()
        away = []
        chunks = None
        for rank in msg.ranks:
            lane = self._lane(rank)
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
            runtime.controller.call(self.route_call, msg if len(away) == len(msg.ranks)
                                    else replace(msg, ranks=tuple(away)))

    def _lane(self, rank: int) -> Lane | None:
        state = self._runtime.ranks.get(rank)
        if state is None or not state.alive or self._runtime.shm_dir_for((rank,)) is None:
            return None
        return self.lanes.get(rank)

    def _on_lane_message(self, msg: Any) -> None:
        if isinstance(msg, m.ActorReply):
            self.calls.deliver(msg)

    def flush_calls(self) -> None:
        """Write calls queued on direct lanes now (a caller is about to wait)."""
        self.lanes.flush()

    def wait_for_replies(self, pending: PendingCall, count: int, timeout: float | None) -> bool:
        """Block until `count` replies are in; local replies are read on this thread."""
        self.lanes.flush()
        done = self.lanes.wait(pending.outstanding, lambda: len(pending.replies) >= count, timeout)
        return pending.wait(count, timeout) if done is None else done

    def send_cancel(self, msg: m.CancelCall) -> None:
        """Ask the ranks of a call to stop it."""
        if not self._runtime.closed:
            self._runtime.controller.call(self.route_cancel, msg)

    def must_not_wait_on(self, ranks: tuple[int, ...]) -> bool:
        """The notebook's thread may always wait (replies arrive on the loop thread)."""
        return False

    def host_of(self, rank: int) -> str:
        """The host a rank runs on."""
        state = self._runtime.ranks.get(rank)
        return state.host if state is not None else ""

    def is_alive(self, rank: int) -> bool:
        """Whether a rank is running (as last reported)."""
        state = self._runtime.ranks.get(rank)
        return state is not None and state.alive

    def watch_failures(self, ranks: Iterable[int], callback: Callable[[int, str], None]) -> None:
        """Call callback(rank, why) (on a helper thread) when one of these ranks dies."""
        self._watchers.append((frozenset(ranks), callback))

    def record_timing(self, label: str, times: list[tuple[int, float | None, bool]]) -> None:
        """Keep per-rank durations of an actor call in the mesh's history."""
        runtime = self._runtime
        now = time.time()
        for rank, seconds, ok in times:
            runtime.history.append(TimingRecord(label, rank, runtime.ranks[rank].host, seconds, ok, now))

    # ------------------------------------------------------------ on the loop thread
    def route_call(self, msg: m.ActorCall) -> None:
        """Send a call to the host agents of its ranks; dead ranks answer with their death."""
        runtime = self._runtime
        for link in runtime.links:
            local = tuple(r for r in link.ranks if r in msg.ranks)
            if not local:
                continue
            alive = tuple(r for r in local
                          if runtime.ranks[r].alive and link.conn is not None and not link.conn.closed)
            for rank in local:
                if rank not in alive:
                    why = runtime.death_failure(runtime.ranks[rank], "is dead").message
                    self.deliver_reply(death_reply(msg.caller, msg.call_id, rank, why))
            if alive:
                self.routed.add(msg.caller, msg.call_id, alive)
                link.conn.send(msg if alive == msg.ranks else replace(msg, ranks=alive))

    def route_cancel(self, msg: m.CancelCall) -> None:
        """Forward a cancellation to the host agents of its ranks."""
        for link in self._runtime.links:
            local = tuple(r for r in link.ranks if r in msg.ranks)
            if local and link.conn is not None and not link.conn.closed:
                link.conn.send(replace(msg, ranks=local))

    def routed_reply(self, reply: m.ActorReply) -> None:
        """A reply from an agent to a call that was routed through here."""
        if self.routed.answered(reply.caller, reply.call_id, reply.rank):
            self.deliver_reply(reply)

    def deliver_reply(self, reply: m.ActorReply) -> None:
        """To the calling rank's agent, or to this process's own call table."""
        if reply.caller == m.CONTROLLER:
            self.calls.deliver(reply)
            return
        for link in self._runtime.links:
            if reply.caller in link.ranks and link.conn is not None and not link.conn.closed:
                link.conn.send(reply)

    def rank_died(self, rank: int, why: str) -> None:
        """Fail every call owed by a dead rank, and tell whoever watches it."""
        self.calls.fail_rank(rank, why)  # calls sent over its direct lane
        for caller, call_id in self.routed.owed_by(rank):
            if self.routed.answered(caller, call_id, rank):
                self.deliver_reply(death_reply(caller, call_id, rank, why))
        for ranks, callback in self._watchers:
            if rank in ranks:
                threading.Thread(target=callback, args=(rank, why), name="mesh-supervision", daemon=True).start()

    def fail_all(self, why: str) -> None:
        """The mesh restarted or shut down: every call in flight fails."""
        self.lanes.close()
        for call in self.calls.pending():
            for rank in call.outstanding:
                self.calls.deliver(death_reply(m.CONTROLLER, call.call_id, rank, why, "MeshRestarted"))
        self.routed = CallTracker()

