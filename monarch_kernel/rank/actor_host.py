"""The actors living on one rank: their instances, mailboxes and the calls they serve.

Every actor has a mailbox served one message at a time, in arrival order (each sender's order: every
route between two processes is one FIFO stream). Sync endpoints run inline on the main thread, so an
interrupt reaches them as KeyboardInterrupt; async endpoints run as tasks on the rank's event loop, so
an actor awaiting another call holds up no other actor. While a sync endpoint (or a `%%mesh` cell)
waits on actor calls, the main thread serves the other actors' mailboxes from inside that wait, so it
may block on another actor of its own rank (as in Ray or Monarch); what cannot finish is reported
(`rank/deadlocks.py`). The rank's own `CallSender` is `rank/rank_sender.py`.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import linecache
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.actors.base import SYSTEM_ACTOR, current_actor, current_point, is_endpoint, takes_port
from monarch_kernel.actors.ports import Port
from monarch_kernel.core.errors import ConnectionClosed, SerializationError
from monarch_kernel.core.shape import Point, Shape
from monarch_kernel.core.supervision import SUPERVISE
from monarch_kernel.rank.cell import describe_failure
from monarch_kernel.rank.deadlocks import not_here, raise_deadlock
from monarch_kernel.rank.interrupts import MainThreadInterrupts
from monarch_kernel.rank.ops import RankOps, SystemActor
from monarch_kernel.rank.rank_sender import RankSender
from monarch_kernel.rank.recent import MAX_REMEMBERED, RecentKeys
from monarch_kernel.wire.calls import CallKey, PendingCall, set_default_sender
from monarch_kernel.wire.messages import ActorCall, ActorReply, CancelCall, Failure
from monarch_kernel.wire.serialization import seal, unseal


@dataclass
class _Mailbox:
    name: str
    key: str
    instance: Any
    shape: Shape
    point: Point
    queue: deque = field(default_factory=deque)
    busy: bool = False
    endpoints: dict = field(default_factory=dict)  # name -> (bound method, is async, label, takes a port)

    def endpoint(self, name: str) -> tuple[Any, bool, str, bool] | None:
        """The endpoint called `name` (looked up once per name), or None."""
        found = self.endpoints.get(name)
        if found is None:
            method = getattr(self.instance, name, None)
            if method is None or not (is_endpoint(method) or name == SUPERVISE):
                return None  # only @endpoint methods answer calls (and __supervise__, asked by the controller)
            found = self.endpoints[name] = (method, inspect.iscoroutinefunction(method),
                                            f"{type(self.instance).__name__}.{name}", takes_port(method))
        return found


class ActorHost:
    """Instances and mailboxes of the actors on one rank."""

    def __init__(self, rank: int, send: Callable[[Any], None], run_user: Callable[..., Any],
                 shm_dir: str | None, ops: RankOps, interrupts: MainThreadInterrupts, mesh: str = ""):
        self.rank = rank
        self.instances: dict[str, Any] = {}  # what `actors[...]` shows in %%mesh cells
        self._mailboxes: dict[str, _Mailbox] = {}  # by spawn key ("name#N")
        self._keys: dict[str, str] = {}  # actor mesh name -> key of its current spawn
        self._retired: dict[str, tuple[str, bool]] = {}  # keys of ended spawns -> (their name, replaced?)
        self._send = send
        self._run_user = run_user  # runs a function with interrupts enabled
        self._interrupts = interrupts
        self._shm_dir = shm_dir
        self._lock = threading.Lock()  # guards the three below (reader thread vs main)
        self._cancelled = RecentKeys()  # may come before its call (other route)
        self._running_sync: list[CallKey] = []  # sync calls on the main thread, outermost first
        self._tasks: dict[CallKey, asyncio.Task] = {}
        self._doing: dict[CallKey, tuple[str, float]] = {}  # endpoints running: label, start time
        self.reported = ""  # the activity last told to the agent
        self.on_idle: Callable[[], None] | None = None  # tells the agent, when set
        self.free_collectives: Callable[[], str] | None = None  # ends a collective the main thread waits in: how
        self._aborted: dict[CallKey, str] = {}  # stopped calls whose collectives were ended, and how
        self._reply_via: dict[CallKey, Callable[[Any], None]] = {}  # loop thread only
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque[tuple[ActorCall, Any]] = deque()  # (call, reply route) in arrival order, for main
        self._wake = threading.Condition()  # a call or a reply arrived (for the main thread's waits)
        self._serving: list[tuple[_Mailbox, str]] = []  # (actor, endpoint label) of the sync calls running, outermost first
        self._answering: dict[CallKey, ActorCall] = {}  # calls whose endpoint took a Port and has not answered
        self.sender = RankSender(rank, send, shm_dir, self.wait_serving, self.notify, self.answer_through_port, mesh)
        self.sender._post_local = self.post_local
        set_default_sender(self.sender)
        ops.serve_actors(self)
        self._mailboxes[SYSTEM_ACTOR] = _Mailbox(SYSTEM_ACTOR, SYSTEM_ACTOR, SystemActor(ops), Shape((), (rank,)),
                                          Point((), 0))

    def spawn(self, name: str, key: str, cls: type, args: tuple, kwargs: dict, shape: Shape,
              sources: dict[str, list[str]]) -> str:
        """Create this rank's instance of actor mesh `name` (in user-code context); `key` names this spawn.

        An earlier actor mesh of that name here is replaced, as re-running a notebook cell expects: its
        queued calls fail, and calls through its old handle say that it was spawned again."""
        for filename, lines in sources.items():
            linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
        point = shape.numbered_point(self.rank) or Point((), 0)
        token, owner = current_point.set(point), current_actor.set(key)
        try:
            instance = cls(*args, **kwargs)
        finally:
            current_point.reset(token)
            current_actor.reset(owner)
        self.stop(name, replaced=True)
        self.instances[name] = instance
        self._keys[name] = key
        self._mailboxes[key] = _Mailbox(name, key, instance, shape, point)
        return f"{cls.__name__} on rank {self.rank}"

    def meshes(self) -> list[tuple[str, str, Any, Shape]]:
        """The actor meshes here: (name, spawn key, this rank's instance, shape)."""
        return [(box.name, box.key, box.instance, box.shape) for box in map(self._mailboxes.get, self._keys.values()) if box]

    def stop_key(self, key: str) -> bool:
        """Stop the actors of one spawn (by key) on this rank; False if it is not (or no longer) here."""
        box = self._mailboxes.get(key)
        if box is None or self._keys.get(box.name) != key:
            return False
        self.stop(box.name)
        return True

    def stop(self, name: str, *, replaced: bool = False) -> None:
        """Forget actor mesh `name` on this rank (its queued calls fail)."""
        key, _ = self._keys.pop(name, None), self.instances.pop(name, None)
        box = self._mailboxes.pop(key, None) if key is not None else None
        if key is None or box is None:
            return
        self._retired[key] = (name, replaced)
        while len(self._retired) > MAX_REMEMBERED:
            del self._retired[next(iter(self._retired))]
        why = ("ActorReplaced", f"actor mesh {name!r} was spawned again") if replaced else \
              ("ActorStopped", f"actor mesh {name!r} was stopped")
        while box.queue:
            self._reply(box.queue.popleft(), None, Failure(*why, ""))

    # ------------------------------------------------------------ reader thread side
    def cancel(self, msg: CancelCall) -> None:
        """Called by the reader thread: stop a call wherever it is."""
        key = (msg.caller, msg.call_id)
        with self._lock:
            self._cancelled.add(key)  # (the oldest, of calls long ended, are forgotten)
            if key in self._running_sync:  # (if others run nested above it, they are stopped with it)
                self._interrupts.interrupt(lambda: key in self._running_sync)
                ended = self.free_collectives() if self.free_collectives is not None else ""
                if ended:  # (a signal cannot reach into a collective's wait: it was ended; its reply says so)
                    self._aborted[key] = ended
            task = self._tasks.get(key)
        if task is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(task.cancel)

    def activity(self) -> str:
        """What the actors of this rank run now, e.g. "Trainer.step 1.5s" ("" when idle).

        Called by the heartbeat thread; what it returns is what the agent believes.
        """
        doing = list(self._doing.values())
        if not doing:
            self.reported = ""
            return ""
        label, started = min(doing, key=lambda d: d[1])
        more = f" (+{len(doing) - 1})" if len(doing) > 1 else ""
        self.reported = f"{label}{more} {time.monotonic() - started:.1f}s"
        return self.reported

    def _ended(self, key: CallKey) -> None:
        self._doing.pop(key, None)
        if self.reported and not self._doing and self.on_idle is not None:
            self.on_idle()  # the agent was told we are busy: say at once that we are not

    def post(self, msg: ActorCall, reply_via: Callable[[Any], None] | None = None) -> None:
        """Called by the reader thread (or a caller on this rank): a call for one of our actors,
        delivered by the main thread (its loop, or a wait that serves)."""
        self._inbox.append((msg, reply_via))
        self.notify()

    def post_local(self, msg: ActorCall) -> None:
        """A call from this rank to its own actors: no trip through the agent, the reply comes back here."""
        self.post(msg, self._local_reply)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.pump)  # for a caller that does not wait (it may never)

    def _local_reply(self, reply: ActorReply) -> None:
        self.sender.calls.deliver(reply)
        self.notify()

    def notify(self) -> None:
        """A call or a reply arrived: wake the main thread if it waits serving (`wait_serving`)."""
        with self._wake:
            self._wake.notify_all()

    # ------------------------------------------------------------ loop side
    def pump(self) -> None:
        """Deliver the calls that arrived, in order (main thread: the loop, or a wait that serves)."""
        while self._inbox:
            self.deliver(*self._inbox.popleft())

    def wait_serving(self, ready: Callable[[], bool], timeout: float | None, pending: PendingCall | None) -> bool:
        """The main thread's wait until ready() (replies to `pending`, or a port's message): meanwhile
        it serves the calls that arrive for the rank's other actors. Raises ActorDeadlockError when a
        wait on `pending` could never end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if ready():
                return True
            if pending is not None:
                self._check_wait(pending)
            if self._inbox:
                self.pump()
                continue
            with self._wake:
                if self._inbox or ready():
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._wake.wait(0.5 if remaining is None else min(remaining, 0.5))

    def _check_wait(self, pending: PendingCall) -> None:
        """Raise if waiting on `pending` could never end (see the module's note)."""
        if self.rank in pending.outstanding:
            box = self._mailboxes.get(pending.actor)
            if box is not None and box.busy:  # (else it will be served from this wait, or answered as not found)
                raise_deadlock(self.rank, pending.label, self._serving, box)

    def deliver(self, msg: ActorCall, reply_via: Callable[[Any], None] | None = None) -> None:
        """Queue a call on its actor's mailbox and serve the mailbox if idle.

        The answer goes back the way the call came: `reply_via` (a direct lane) or the agent.
        """
        if reply_via is not None:
            self._reply_via[(msg.caller, msg.call_id)] = reply_via
        box = self._mailboxes.get(msg.actor)
        if box is None:
            self._reply(msg, None, not_here(self.rank, msg.actor, self._retired.get(msg.actor), self._keys))
            return
        box.queue.append(msg)
        if not box.busy:
            self._drain(box)

    def _drain(self, box: _Mailbox) -> None:
        while box.queue and not box.busy:
            msg = box.queue.popleft()
            key = (msg.caller, msg.call_id)
            with self._lock:
                cancelled = key in self._cancelled
            if cancelled:
                self._reply(msg, None, Failure("KeyboardInterrupt", "cancelled before it started", "",
                                               interrupted=True))
                continue
            found = box.endpoint(msg.endpoint)
            if found is None:
                self._reply(msg, None, Failure(
                    "AttributeError", f"{type(box.instance).__name__} has no endpoint {msg.endpoint!r} "
                    "(only methods marked @endpoint answer calls)", ""))
                continue
            method, is_async, label, with_port = found
            try:
                args, kwargs = unseal(msg.args)
            except Exception as exc:  # noqa: BLE001
                self._reply(msg, None, describe_failure(exc))
                continue
            if with_port:  # it answers through the port it is given: now, or later
                if msg.to_port:  # sent with send(..., port=): that port, as it is
                    args = (Port(msg.caller, msg.call_id), *args)
                else:
                    args = (Port(msg.caller, msg.call_id, answers=self.rank), *args)
                    with self._lock:
                        self._answering[key] = msg
            if is_async:
                assert self.loop is not None, "async endpoints need the rank's event loop"
                box.busy = True
                task = self.loop.create_task(self._serve_async(box, msg, method, label, args, kwargs),
                                             context=_context_at(_point_of(box, msg), box.key))
                with self._lock:
                    self._tasks[key] = task
            else:
                # its later calls wait, even those served from inside this one's waits; the system actor
                # is the exception: a constructor it runs may spawn on this rank again
                box.busy = box.key != SYSTEM_ACTOR
                try:
                    self._serve_sync(box, msg, method, label, args, kwargs)
                finally:
                    box.busy = False

    def _serve_sync(self, box: _Mailbox, msg: ActorCall, method, label: str, args, kwargs) -> None:
        key = (msg.caller, msg.call_id)
        with self._lock:
            if key in self._cancelled:  # the stop came after the mailbox's check, before this: no signal reached it
                cancelled = True
            else:
                cancelled = False
                self._running_sync.append(key)
        if cancelled:
            self._reply(msg, None, Failure("KeyboardInterrupt", "cancelled before it started", "", interrupted=True))
            return
        token, owner = current_point.set(_point_of(box, msg)), current_actor.set(box.key)
        self._serving.append((box, label))
        started = time.perf_counter()
        self._doing[key] = (label, time.monotonic())
        def run() -> Any:
            # inside user code already (a SIGINT from now on raises here); a stop that came before,
            # while the signal would have been ignored, is caught by this check
            with self._lock:
                if key in self._cancelled:
                    raise KeyboardInterrupt
            return method(*args, **kwargs)

        try:
            value, failure = self._run_user(run), None
        except BaseException as exc:  # noqa: BLE001 - every endpoint error goes to its caller
            value, failure = None, describe_failure(exc)
        finally:
            self._serving.pop()
            with self._lock:
                self._running_sync.remove(key)
            self._ended(key)
            current_point.reset(token)
            current_actor.reset(owner)
        self._answer(box, msg, value, failure, time.perf_counter() - started)

    async def _serve_async(self, box: _Mailbox, msg: ActorCall, method, label: str, args, kwargs) -> None:
        started = time.perf_counter()
        key = (msg.caller, msg.call_id)
        self._doing[key] = (label, time.monotonic())
        try:
            value, failure = await method(*args, **kwargs), None
        except asyncio.CancelledError:
            value, failure = None, Failure("KeyboardInterrupt", "cancelled while it ran", "", interrupted=True)
        except BaseException as exc:  # noqa: BLE001
            value, failure = None, describe_failure(exc)
        with self._lock:
            self._tasks.pop(key, None)
        self._ended(key)
        self._answer(box, msg, value, failure, time.perf_counter() - started)
        box.busy = False
        self._drain(box)

    def _answer(self, box: _Mailbox, msg: ActorCall, value: Any, failure: Failure | None, seconds: float) -> None:
        """An endpoint ended: reply with what it returned, unless it answers through its port."""
        found = box.endpoint(msg.endpoint)
        if found is None or not found[3]:
            self._reply(msg, value, failure, seconds)
        elif failure is not None:  # it raised before answering: the caller hears why (once)
            if msg.to_port:
                self._reply(msg, None, failure, seconds)
            else:
                self.answer_through_port(msg.caller, msg.call_id, None, failure)

    def answer_through_port(self, caller: int, call_id: int, value: Any, failure: Failure | None) -> bool:
        """Answer a call whose endpoint took a Port (any thread); False if it has no call waiting."""
        with self._lock:
            msg = self._answering.pop((caller, call_id), None)
        if msg is None:
            return False
        self._reply(msg, value, failure)
        return True

    def _reply(self, msg: ActorCall, value: Any, failure: Failure | None, seconds: float | None = None) -> None:
        key = (msg.caller, msg.call_id)
        with self._lock:
            self._cancelled.discard(key)
        send = self._reply_via.pop(key, self._send)
        sealed = None
        if failure is None and msg.want_value and value is not None:
            try:
                sealed = seal(value, shm_dir=None if msg.from_mesh else self._shm_dir)  # (not another mesh's files)
            except SerializationError as exc:
                failure = Failure("SerializationError", f"the reply of {msg.endpoint} could not be sent: {exc}", "")
        try:
            send(ActorReply(msg.caller, msg.call_id, self.rank, sealed, failure, seconds, to_port=msg.to_port,
                            aborted=self._aborted.pop(key, "")))
        except ConnectionClosed:
            pass  # the caller went away


def _point_of(box: _Mailbox, msg: ActorCall) -> Point:
    """current_rank() in an endpoint: the actor's point in the (sliced) mesh the call was sent through."""
    through = msg.through
    found = None if through is None else Shape(*through).numbered_point(box.shape.ranks[box.point.rank])
    return box.point if found is None else found


def _context_at(point: Point, key: str) -> contextvars.Context:
    ctx = contextvars.copy_context()
    ctx.run(current_point.set, point)
    ctx.run(current_actor.set, key)
    return ctx
