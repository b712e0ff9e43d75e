"""Bookkeeping of actor calls, shared by every process that sends or routes them.

`CallTracker` is the router's view (agent, controller): which ranks still owe an
answer to which call, so that a rank's death turns into prompt failure replies.
`CallTable` is the caller's view (notebook or rank): one `PendingCall` per call,
filled in by replies from any thread and waited on by threads or asyncio tasks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from monarch_kernel.core.ids import fresh_ids
from monarch_kernel.core.supervision import MeshFailure
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.wire.messages import (
    CONTROLLER,
    ActorCall,
    ActorReply,
    CancelCall,
    Failure,
    FailureCause,
    ForSupervisors,
)

CallKey = tuple[int, int]  # (caller, call_id)


class CallTracker:
    """Which ranks owe a reply to which routed call."""

    def __init__(self) -> None:
        self._owed: dict[CallKey, set[int]] = {}
        self._by_rank: dict[int, set[CallKey]] = {}

    def add(self, caller: int, call_id: int, ranks: Iterable[int]) -> None:
        """A call was routed to these ranks."""
        key = (caller, call_id)
        owed = self._owed.setdefault(key, set())
        for rank in ranks:
            owed.add(rank)
            self._by_rank.setdefault(rank, set()).add(key)

    def answered(self, caller: int, call_id: int, rank: int) -> bool:
        """A rank answered; False if that answer was not owed (a duplicate or late one)."""
        key = (caller, call_id)
        owed = self._owed.get(key)
        if owed is None or rank not in owed:
            return False
        owed.discard(rank)
        if not owed:
            del self._owed[key]
        keys = self._by_rank.get(rank)
        if keys is not None:
            keys.discard(key)
        return True

    def owed_by(self, rank: int) -> list[CallKey]:
        """Every call still waiting on this rank (e.g. because it just died)."""
        return sorted(self._by_rank.get(rank, ()))


def death_reply(caller: int, call_id: int, rank: int, why: str, cause: FailureCause = FailureCause.RANK_DIED, *,
                to_port: bool = False) -> ActorReply:
    """The reply a router sends on behalf of a rank that died (or a mesh that went away) before answering."""
    return ActorReply(caller, call_id, rank, None, Failure.of(cause, why), to_port=to_port)


class PendingCall:
    """A call in flight from this process: replies by rank, as they arrive.

    Thread-safe: replies are added by an I/O thread, waiters are the notebook thread,
    other threads, or asyncio tasks on any loop.
    """

    def __init__(self, call_id: int, ranks: tuple[int, ...], label: str,
                 on_reply: Callable[[ActorReply], None] | None = None):
        self.call_id = call_id
        self.ranks = ranks
        self.label = label
        self.actor = ""  # the key of the actor mesh called (a rank waiting on its own actors checks it)
        self.replies: dict[int, ActorReply] = {}
        self.arrivals: list[int] = []  # ranks in the order their replies came
        self.on_reply = on_reply
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None  # made by the first blocking waiter
        self._wanted: list[int] = []  # reply counts that blocked waiters wait for
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def add(self, reply: ActorReply) -> bool:
        """Record one rank's reply (the first one wins); True when it was new."""
        with self._lock:
            if reply.rank in self.replies or reply.rank not in self.ranks:
                return False
            self.replies[reply.rank] = reply
            self.arrivals.append(reply.rank)
            if self._cond is not None and self._wanted and len(self.replies) >= min(self._wanted):
                self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)
        if self.on_reply is not None:
            self.on_reply(reply)
        return True

    @property
    def outstanding(self) -> tuple[int, ...]:
        """Ranks that have not answered yet."""
        with self._lock:
            return tuple(r for r in self.ranks if r not in self.replies)

    def done(self) -> bool:
        """Whether every rank answered."""
        return len(self.replies) == len(self.ranks)

    def wait(self, count: int, timeout: float | None) -> bool:
        """Block until at least `count` replies are in (True) or the timeout passes."""
        with self._lock:
            if self._cond is None:
                self._cond = threading.Condition(self._lock)
            self._wanted.append(count)
            try:
                return self._cond.wait_for(lambda: len(self.replies) >= count, timeout)
            finally:
                self._wanted.remove(count)

    async def wait_async(self, count: int) -> None:
        """Wait on the current asyncio loop until at least `count` replies are in."""
        await wait_registered(self._lock, lambda: len(self.replies) >= count, self._waiters)


def poll_until(ready: Callable[[], bool], timeout: float | None, interval: float = 0.005) -> bool:
    """Check ready() every `interval` until it holds (True) or the timeout passes (False)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


async def wait_registered(lock: threading.Lock | threading.Condition, ready: Callable[[], bool],
                          waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
    """Wait on the running asyncio loop until ready(): each try registers a future in `waiters`
    (under `lock`), which whoever makes ready() true wakes with `_wake` through its loop."""
    loop = asyncio.get_running_loop()
    while True:
        with lock:
            if ready():
                return
            fut = loop.create_future()
            entry = (loop, fut)
            waiters.append(entry)
        try:
            await fut
        finally:
            with lock:
                waiters.remove(entry)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class CallTable:
    """The calls this process has in flight, by id."""

    def __init__(self) -> None:
        self._ids = fresh_ids()
        self._calls: dict[int, PendingCall] = {}
        self._lock = threading.Lock()

    def new(self, ranks: tuple[int, ...], label: str,
            on_reply: Callable[[ActorReply], None] | None = None) -> PendingCall:
        """Register a call about to be sent."""
        with self._lock:
            call = PendingCall(next(self._ids), ranks, label, on_reply)
            self._calls[call.call_id] = call
        return call

    def deliver(self, reply: ActorReply) -> None:
        """Hand a reply to its call; forget the call once every rank answered.

        A message sent through a Port goes to this process's open port of that id instead."""
        if reply.to_port:
            PORTS.deliver(reply)
            return
        with self._lock:
            call = self._calls.get(reply.call_id)
        if call is None:
            return
        call.add(reply)
        if call.done():
            with self._lock:
                self._calls.pop(reply.call_id, None)

    def in_flight(self, call_id: int) -> bool:
        """Whether call `call_id` still waits on a rank's answer."""
        call = self._calls.get(call_id)  # (a dict read: atomic)
        return call is not None and not call.done()

    def fail_rank(self, rank: int, why: str) -> None:
        """A rank is gone: every call still waiting on it fails there."""
        with self._lock:
            calls = [c for c in self._calls.values() if rank in c.ranks]
        for call in calls:
            self.deliver(death_reply(CONTROLLER, call.call_id, rank, why))

    def pending(self) -> list[PendingCall]:
        """Calls still in flight."""
        with self._lock:
            return list(self._calls.values())


class OpenPort:
    """The receiving end of a Port in this process: the messages sent through it, in arrival order.

    Thread-safe like PendingCall: messages are added by an I/O thread (or a sender in this
    process) and taken by the notebook thread, another thread, or an asyncio task.
    """

    def __init__(self, port_id: int, once: bool):
        self.port_id = port_id
        self.once = once
        self._items: deque[ActorReply] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def add(self, msg: ActorReply) -> None:
        """A message arrived."""
        with self._cond:
            self._items.append(msg)
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)

    def ready(self) -> bool:
        """Whether a message is waiting to be taken."""
        return bool(self._items)

    def take(self) -> ActorReply:
        """The oldest message (call after ready() or a wait said one is there)."""
        with self._cond:
            return self._items.popleft()

    def wait(self, timeout: float | None) -> bool:
        """Block until a message is there (True) or the timeout passes."""
        with self._cond:
            return self._cond.wait_for(self.ready, timeout)

    async def wait_async(self) -> None:
        """Wait on the current asyncio loop until a message is there."""
        await wait_registered(self._cond, self.ready, self._waiters)


class _ForwardingPort(OpenPort):
    """A port whose messages go on elsewhere (the controller's, for a call from another mesh)."""

    def __init__(self, port_id: int, forward: Callable[[ActorReply], None]):
        super().__init__(port_id, once=False)
        self._forward = forward

    def add(self, msg: ActorReply) -> None:
        """Pass the message on."""
        self._forward(msg)


class PortTable:
    """The ports open in this process, by id (one table per process: every mesh's replies reach it)."""

    def __init__(self) -> None:
        self._ids = fresh_ids()
        self._ports: dict[int, OpenPort] = {}
        self._lock = threading.Lock()

    def open(self, once: bool = False) -> OpenPort:
        """A new port; its id goes into the Port handle that others send through."""
        with self._lock:
            port = OpenPort(next(self._ids), once)
            self._ports[port.port_id] = port
        return port

    def open_forwarding(self, forward: Callable[[ActorReply], None]) -> OpenPort:
        """A port that hands each message to `forward` (on the thread that delivers it) instead of keeping it."""
        with self._lock:
            port = _ForwardingPort(next(self._ids), forward)
            self._ports[port.port_id] = port
        return port

    def close(self, port_id: int) -> None:
        """Forget a port: later messages to it are dropped."""
        with self._lock:
            self._ports.pop(port_id, None)

    def deliver(self, msg: ActorReply) -> None:
        """Hand a message to its port (a once-port takes one, then closes)."""
        with self._lock:
            port = self._ports.get(msg.call_id)
            if port is not None and port.once:
                del self._ports[msg.call_id]
        if port is not None:
            port.add(msg)


PORTS = PortTable()


class CallSender(Protocol):
    """What an actor mesh handle needs from the process it lives in (notebook or rank)."""

    caller_id: int
    calls: CallTable

    @property
    def own_rank(self) -> int | None:
        """The rank this process is (None: the notebook)."""

    @property
    def mesh_name(self) -> str:
        """The mesh this sender sends to (a rank's own mesh)."""

    def other_mesh(self, mesh_name: str) -> bool:
        """Whether calls to actors of `mesh_name` leave this sender's mesh (a rank's call to another
        mesh of the notebook: it goes through the controller)."""

    def send_up(self, msg: ForSupervisors) -> None:
        """Tell the controller what this rank's actors need of it: supervision, processes (ranks only)."""

    def answer(self, caller: int, call_id: int, value: Any, failure: Failure | None) -> bool:
        """Answer a call to this process whose endpoint took a Port (False: no such call waits here)."""

    def send_call(self, msg: ActorCall) -> None:
        """Send a call towards its ranks."""

    def send_cancel(self, msg: CancelCall) -> None:
        """Ask the ranks of a call to stop it."""

    def send_port(self, msg: ActorReply) -> None:
        """Send a message through a Port opened by another process (`msg.caller` owns it)."""

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ready() (True) or the timeout passes (False); a rank serves its actors meanwhile."""

    def shm_dir_for(self, ranks: tuple[int, ...]) -> str | None:
        """A shared-memory folder for large arguments to these ranks, if they are on this machine."""

    def regroup(self, aborted: dict[int, str]) -> str | None:
        """A stopped call's endpoints were in collectives, ended on the ranks of `aborted` (rank -> how): have
        every rank make a fresh default group; the line that says what was done (None: nothing)."""

    def flush_calls(self) -> None:
        """Write queued calls now (a caller is about to wait)."""

    def wait_for_replies(self, pending: PendingCall, count: int, timeout: float | None) -> bool:
        """Block until `count` replies are in (True) or the timeout passes (False)."""

    def host_of(self, rank: int) -> str:
        """The host a rank runs on ("" where unknown)."""

    def is_alive(self, rank: int) -> bool:
        """Whether a rank is running, as far as this process knows."""

    def watch_failures(self, ranks: Iterable[int], callback: Callable[[int, str], None]) -> None:
        """Call callback(rank, why) when one of these ranks dies."""

    def watch_actor_failures(self, key: str, callback: Callable[[MeshFailure], None]) -> None:
        """Call callback(failure) when an actor of spawn `key` fails (its endpoint raised what ends an actor)."""

    def record_timing(self, label: str, title: str, times: list[RankTiming]) -> None:
        """Keep (and show, where someone shows them) per-rank durations of a call."""


_senders: dict[str, CallSender] = {}
_default_sender: list[CallSender] = []


def register_sender(mesh_name: str, sender: CallSender) -> None:
    """The controller's sender for a mesh (in the notebook's process)."""
    _senders[mesh_name] = sender


def unregister_sender(mesh_name: str, sender: CallSender) -> None:
    """Forget a shut-down mesh's sender (unless a newer mesh of that name replaced it)."""
    if _senders.get(mesh_name) is sender:
        del _senders[mesh_name]


def set_default_sender(sender: CallSender) -> None:
    """The sender of a rank process (it belongs to exactly one mesh)."""
    _default_sender[:] = [sender]


def find_sender(mesh_name: str) -> CallSender | None:
    """How this process reaches the ranks of mesh `mesh_name`, if it can ("": of the one mesh there is)."""
    found = _senders.get(mesh_name) or (_default_sender[0] if _default_sender else None)
    if found is None and not mesh_name and len(_senders) == 1:
        found = next(iter(_senders.values()))
    return found
