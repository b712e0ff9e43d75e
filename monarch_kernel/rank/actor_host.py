"""The actors living on one rank: their instances, mailboxes and the calls they serve.

Every actor has a mailbox served one message at a time, in arrival order (which is
each sender's order: every route between two processes is one FIFO stream). Sync
endpoints run inline on the rank's main thread, so an interrupt reaches them as
KeyboardInterrupt; async endpoints run as tasks on the rank's event loop, so an actor
awaiting another call does not hold up the other actors of the rank.

The rank's `CallSender` lives here too: actor meshes used inside an endpoint or a
`%%mesh` cell send their calls through the rank's host agent.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import linecache
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.actors.base import current_point, is_endpoint
from monarch_kernel.core.errors import ConnectionClosed, MeshUsageError, SerializationError
from monarch_kernel.core.shape import Point, Shape
from monarch_kernel.rank.cell import describe_failure
from monarch_kernel.wire.calls import CallKey, CallTable, PendingCall, set_default_sender
from monarch_kernel.wire.messages import ActorCall, ActorReply, CancelCall, Failure
from monarch_kernel.wire.serialization import seal, unseal

MAX_REMEMBERED_CANCELS = 10_000


@dataclass
class _Mailbox:
    name: str
    instance: Any
    shape: Shape
    point: Point
    queue: deque = field(default_factory=deque)
    busy: bool = False
    endpoints: dict = field(default_factory=dict)  # name -> (bound method, is async, label)

    def endpoint(self, name: str) -> tuple[Any, bool, str] | None:
        """The endpoint called `name` (looked up once per name), or None."""
        found = self.endpoints.get(name)
        if found is None:
            method = getattr(self.instance, name, None)
            if method is None or not is_endpoint(method):
                return None  # only @endpoint methods answer calls
            found = self.endpoints[name] = (method, inspect.iscoroutinefunction(method),
                                            f"{type(self.instance).__name__}.{name}")
        return found


class RankSender:
    """Sends this rank's own actor calls through its host agent."""

    def __init__(self, rank: int, send: Callable[[Any], None], shm_dir: str | None):
        self.caller_id = rank
        self.own_rank = rank
        self.calls = CallTable()
        self._send = send
        self._shm_dir = shm_dir

    def send_call(self, msg: ActorCall) -> None:
        """Hand a call to the host agent, which routes it."""
        self._send(msg)

    def send_cancel(self, msg: CancelCall) -> None:
        """Ask the ranks of a call to stop it."""
        self._send(msg)

    def shm_dir_for(self, ranks: tuple[int, ...]) -> str | None:
        """Large arguments go through shared memory when the mesh is on one machine."""
        return self._shm_dir

    def flush_calls(self) -> None:
        """Calls go out as they are made (no queue to flush)."""

    def wait_for_replies(self, pending: PendingCall, count: int, timeout: float | None) -> bool:
        """Replies are delivered by the rank's reader thread: just wait."""
        return pending.wait(count, timeout)

    def must_not_wait_on(self, ranks: tuple[int, ...]) -> bool:
        """Blocking on our own rank from its main thread would wait forever."""
        return self.own_rank in ranks and threading.current_thread() is threading.main_thread()

    def host_of(self, rank: int) -> str:
        """Ranks do not track where other ranks run."""
        return ""

    def is_alive(self, rank: int) -> bool:
        """Ranks do not track other ranks' health (the agent answers for dead ones)."""
        return True

    def watch_failures(self, ranks: Iterable[int], callback: Callable[[int, str], None]) -> None:
        """Supervision is the notebook's: a rank cannot watch other ranks."""
        raise MeshUsageError("on_failure() is for the notebook that spawned the actors")

    def record_timing(self, label: str, title: str, times: list[tuple[int, float | None, bool]]) -> None:
        """Ranks keep no timing history."""


class ActorHost:
    """Instances and mailboxes of the actors on one rank."""

    def __init__(self, rank: int, send: Callable[[Any], None], run_user: Callable[..., Any],
                 shm_dir: str | None):
        self.rank = rank
        self.instances: dict[str, Any] = {}  # what `actors[...]` shows in %%mesh cells
        self._mailboxes: dict[str, _Mailbox] = {}  # by spawn key ("name#N")
        self._keys: dict[str, str] = {}  # actor mesh name -> key of its current spawn
        self._retired: dict[str, str] = {}  # keys of replaced spawns -> their name
        self._send = send
        self._run_user = run_user  # runs a function with interrupts enabled
        self._shm_dir = shm_dir
        self._lock = threading.Lock()  # guards the three below (reader thread vs main)
        self._cancelled: dict[CallKey, None] = {}  # may come before its call (other route)
        self._running_sync: CallKey | None = None
        self._tasks: dict[CallKey, asyncio.Task] = {}
        self._doing: dict[CallKey, tuple[str, float]] = {}  # endpoints running: label, start time
        self.reported = ""  # the activity last told to the agent
        self.on_idle: Callable[[], None] | None = None  # tells the agent, when set
        self._reply_via: dict[CallKey, Callable[[Any], None]] = {}  # loop thread only
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sender = RankSender(rank, send, shm_dir)
        set_default_sender(self.sender)

    # ------------------------------------------------------------ spawning
    def spawn(self, name: str, key: str, cls: type, args: tuple, kwargs: dict, shape: Shape,
              sources: dict[str, list[str]]) -> str:
        """Create this rank's instance of actor mesh `name` (runs in user-code context).

        `key` identifies this spawn in calls. An earlier actor mesh of the same name on
        this rank is replaced, as re-running a notebook cell expects: its queued calls
        fail, and calls through its old handle say that it was spawned again.
        """
        for filename, lines in sources.items():
            linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
        point = next(p for p in shape.points() if p.rank == self.rank)
        token = current_point.set(point)
        try:
            instance = cls(*args, **kwargs)
        finally:
            current_point.reset(token)
        self.stop(name, replaced=True)
        self.instances[name] = instance
        self._keys[name] = key
        self._mailboxes[key] = _Mailbox(name, instance, shape, point)
        return f"{cls.__name__} on rank {self.rank}"

    def stop(self, name: str, *, replaced: bool = False) -> None:
        """Forget actor mesh `name` on this rank (its queued calls fail)."""
        key = self._keys.pop(name, None)
        box = self._mailboxes.pop(key, None) if key is not None else None
        self.instances.pop(name, None)
        if key is None or box is None:
            return
        self._retired[key] = name
        while len(self._retired) > MAX_REMEMBERED_CANCELS:
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
            self._cancelled[key] = None
            while len(self._cancelled) > MAX_REMEMBERED_CANCELS:  # of calls that already ended
                del self._cancelled[next(iter(self._cancelled))]
            if self._running_sync == key:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
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

    # ------------------------------------------------------------ loop side
    def deliver(self, msg: ActorCall, reply_via: Callable[[Any], None] | None = None) -> None:
        """Queue a call on its actor's mailbox and serve the mailbox if idle.

        The answer goes back the way the call came: `reply_via` (a direct lane) or the agent.
        """
        if reply_via is not None:
            self._reply_via[(msg.caller, msg.call_id)] = reply_via
        box = self._mailboxes.get(msg.actor)
        if box is None:
            self._reply(msg, None, self._not_found(msg.actor))
            return
        box.queue.append(msg)
        if not box.busy:
            self._drain(box)

    def _not_found(self, key: str) -> Failure:
        name = self._retired.get(key)
        if name is not None:
            return Failure("ActorReplaced", f"actor mesh {name!r} was spawned again on rank {self.rank}; this "
                           "handle still points at the old actors: use the one the new spawn() returned", "")
        known = ", ".join(sorted(self._keys)) or "none"
        return Failure("ActorNotFound", f"no actor mesh {key.split('#')[0]!r} on rank {self.rank} (actor meshes "
                       f"here: {known}); it was never spawned here, or the mesh restarted", "")

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
            method, is_async, label = found
            try:
                args, kwargs = unseal(msg.args)
            except Exception as exc:  # noqa: BLE001
                self._reply(msg, None, describe_failure(exc))
                continue
            if is_async:
                assert self.loop is not None, "async endpoints need the rank's event loop"
                box.busy = True
                task = self.loop.create_task(self._serve_async(box, msg, method, label, args, kwargs),
                                             context=_context_at(box.point))
                with self._lock:
                    self._tasks[key] = task
            else:
                self._serve_sync(box, msg, method, label, args, kwargs)

    def _serve_sync(self, box: _Mailbox, msg: ActorCall, method, label: str, args, kwargs) -> None:
        key = (msg.caller, msg.call_id)
        token = current_point.set(box.point)
        with self._lock:
            self._running_sync = key
        started = time.perf_counter()
        self._doing[key] = (label, time.monotonic())
        try:
            value, failure = self._run_user(method, *args, **kwargs), None
        except BaseException as exc:  # noqa: BLE001 - every endpoint error goes to its caller
            value, failure = None, describe_failure(exc)
        finally:
            with self._lock:
                self._running_sync = None
            self._ended(key)
            current_point.reset(token)
        self._reply(msg, value, failure, time.perf_counter() - started)

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
        self._reply(msg, value, failure, time.perf_counter() - started)
        box.busy = False
        self._drain(box)

    def _reply(self, msg: ActorCall, value: Any, failure: Failure | None, seconds: float | None = None) -> None:
        key = (msg.caller, msg.call_id)
        with self._lock:
            self._cancelled.pop(key, None)
        send = self._reply_via.pop(key, self._send)
        sealed = None
        if failure is None and msg.want_value and value is not None:
            try:
                sealed = seal(value, shm_dir=self._shm_dir)
            except SerializationError as exc:
                failure = Failure("SerializationError", f"the reply of {msg.endpoint} could not be sent: {exc}", "")
        try:
            send(ActorReply(msg.caller, msg.call_id, self.rank, sealed, failure, seconds))
        except ConnectionClosed:
            pass  # the caller went away


def _context_at(point: Point) -> contextvars.Context:
    ctx = contextvars.copy_context()
    ctx.run(current_point.set, point)
    return ctx
