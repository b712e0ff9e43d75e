"""The rank's `CallSender`: actor meshes used inside an endpoint or a `%%mesh` cell send their
calls through the rank's host agent, and calls to the rank's own actors go straight to them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.supervision import MeshFailure
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.rank.direct_calls import DirectCalls
from monarch_kernel.wire.calls import PORTS, CallTable, PendingCall
from monarch_kernel.wire.messages import ActorCall, ActorReply, CancelCall, Failure, ForSupervisors


class RankSender:
    """Sends this rank's own actor calls through its host agent."""

    def __init__(self, rank: int, send: Callable[[Any], None], shm_dir: str | None,
                 wait: Callable[[Callable[[], bool], float | None, PendingCall | None], bool],
                 notify: Callable[[], None], answer: Callable[[int, int, Any, Failure | None], bool],
                 mesh_name: str = ""):
        self.caller_id = rank
        self.own_rank = rank
        self.mesh_name = mesh_name
        self.calls = CallTable()
        self._send = send
        self._shm_dir = shm_dir
        self._wait = wait  # a wait that reports a deadlock among the rank's own actors
        self._notify = notify  # wakes that wait
        self._answer = answer  # answers a call whose endpoint took a Port
        self._post_local: Callable[[ActorCall], None] | None = None  # calls to this rank's own actors
        self.direct = DirectCalls(self._direct_reply, mesh_name, self.calls.in_flight,  # to other meshes' ranks,
                                  lambda: [call.call_id for call in self.calls.pending()])  # and its own elsewhere

    def send_call(self, msg: ActorCall) -> None:
        """Hand a call to the host agent, which routes it; this rank's own part goes straight to its
        actors (every call of this sender to them takes that one way, so their order holds)."""
        if msg.mesh:  # another mesh's: straight to its ranks once the controller said where, else the long way
            if not self.direct.send(msg):
                self.direct.went_long_way(msg)
                self._send(msg)
            return
        if self.own_rank not in msg.ranks and self.direct.send(msg, self.mesh_name):  # (ranks of other hosts,
            return                                                    # once the controller said where: on links)
        if self._post_local is None or self.own_rank not in msg.ranks:
            self.direct.went_long_way(msg, self.mesh_name)
            self._send(msg)
            return
        others = tuple(r for r in msg.ranks if r != self.own_rank)
        if others:
            self.direct.went_long_way(msg, self.mesh_name)
            self._send(dataclasses.replace(msg, ranks=others))
        self._post_local(dataclasses.replace(msg, ranks=(self.own_rank,)))

    def send_cancel(self, msg: CancelCall) -> None:
        """Ask the ranks of a call to stop it (the way the call went)."""
        if msg.mesh:
            sent = self.direct.send(msg)
        else:
            sent = self.own_rank not in msg.ranks and self.direct.send(msg, self.mesh_name)
        if not sent:
            self._send(msg)

    def _direct_reply(self, reply: ActorReply) -> None:
        """A reply on a lane to another mesh's rank: to this rank's call (it went out under another caller id)."""
        self.calls.deliver(dataclasses.replace(reply, caller=self.caller_id))
        self._notify()

    def other_mesh(self, mesh_name: str) -> bool:
        """Whether `mesh_name` is another mesh than this rank's ("" is its own)."""
        return bool(mesh_name) and mesh_name != self.mesh_name

    def send_up(self, msg: ForSupervisors) -> None:
        """Tell the controller that an actor of this rank owns an actor mesh, that a broadcast it sent
        failed (it routes failures to __supervise__), or that it starts or stops processes."""
        self._send(msg)

    def shm_dir_for(self, ranks: tuple[int, ...]) -> str | None:
        """Large arguments go through shared memory when the mesh is on one machine."""
        return self._shm_dir

    def regroup(self, aborted: dict[int, str]) -> str | None:
        """A rank cannot have the others make a group anew: say what to do."""
        return (f"stopping the call ended collectives on ranks {sorted(aborted)}; the process group is broken "
                "there until the notebook makes it anew: stop the cell or call that waits, or %mesh restart")

    def flush_calls(self) -> None:
        """Calls go out as they are made (no queue to flush)."""

    def wait_for_replies(self, pending: PendingCall, count: int, timeout: float | None) -> bool:
        """Replies are delivered by the rank's reader thread (or its loop, or a lane): wait, any thread."""
        return self._wait(lambda: len(pending.replies) >= count, timeout, pending)

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ready() (a port's message), any thread."""
        return self._wait(ready, timeout, None)

    def send_port(self, msg: ActorReply) -> None:
        """A message through another process's Port: to this rank's own port, or via the agent."""
        if msg.caller == self.own_rank and not msg.mesh:
            PORTS.deliver(msg)
            self._notify()
        else:
            self._send(msg)

    def answer(self, caller: int, call_id: int, value: Any, failure: Failure | None) -> bool:
        """Answer a call of this rank whose endpoint took a Port (False: it has no such call waiting)."""
        return self._answer(caller, call_id, value, failure)

    def host_of(self, rank: int) -> str:
        """Ranks do not track where other ranks run."""
        return ""

    def is_alive(self, rank: int) -> bool:
        """Ranks do not track other ranks' health (the agent answers for dead ones)."""
        return True

    def watch_failures(self, ranks: Iterable[int], callback: Callable[[int, str], None]) -> None:
        """Supervision is the notebook's: a rank cannot watch other ranks."""
        raise MeshUsageError("on_failure() is for the notebook that spawned the actors")

    def watch_actor_failures(self, key: str, callback: Callable[[MeshFailure], None]) -> None:
        """An actor's failures reach its owning actor through the controller (`send_up`), not a watch here."""
        raise MeshUsageError("the notebook watches the actors it spawned; an actor hears of its own through "
                             "__supervise__")

    def record_timing(self, label: str, title: str, times: list[RankTiming]) -> None:
        """Ranks keep no timing history."""


