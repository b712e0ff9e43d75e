"""The actors living on one rank: their instances, mailboxes and the calls they serve.

Every actor has a mailbox served one call at a time, in arrival order (each sender's order: every
route between two processes is one FIFO stream). Calls are delivered on the rank's event loop; an
async actor's endpoints run as tasks on its own loop (`rank/actor_loops.py`, as in Monarch: an actor
that blocks its loop holds no other); a sync endpoint runs on the main thread when it is free and
on its actor's own thread otherwise (`rank/user_threads.py`), so the actors of a rank serve their
calls at the same time, as in Monarch, and an endpoint may block on another actor of its own rank.
A stop reaches a sync endpoint as KeyboardInterrupt wherever it runs; what could never finish is
reported (`rank/deadlocks.py`). The rank's own `CallSender` is `rank/rank_sender.py`.

Beside this module: how an actor's instance is made and ended (`rank/actor_instances.py`), and what
happens when an actor fails (`rank/actor_failures.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import linecache
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from monarch_kernel.actors.base import SYSTEM_ACTOR, current_actor, current_point
from monarch_kernel.actors.identities import forget_identity, register_identity
from monarch_kernel.actors.log_prefix import install as install_log_prefix
from monarch_kernel.actors.owned import stop_owned
from monarch_kernel.actors.ports import Port
from monarch_kernel.actors.rank_loop import set_rank_loop
from monarch_kernel.core.future import Future
from monarch_kernel.core.identity import ActorIdentity, root_identity
from monarch_kernel.core.shape import Point, Shape
from monarch_kernel.core.supervision import SUPERVISE
from monarch_kernel.rank.activity import EndpointActivity
from monarch_kernel.rank.actor_failures import ActorFailures
from monarch_kernel.rank.actor_instances import construct, constructor_traceback, end_instance
from monarch_kernel.rank.actor_lanes import ActorLanes
from monarch_kernel.rank.actor_loops import ActorLoop
from monarch_kernel.rank.call_order import BehindRequests
from monarch_kernel.rank.call_replies import CallReplies
from monarch_kernel.rank.cell import describe_failure
from monarch_kernel.rank.deadlocks import WaitGraph
from monarch_kernel.rank.interrupts import MainThreadInterrupts
from monarch_kernel.rank.mailbox import Mailbox, Mailboxes, context_at, point_of, prepare_call, serves_async
from monarch_kernel.rank.ops import RankOps, SystemActor
from monarch_kernel.rank.rank_sender import RankSender
from monarch_kernel.rank.runs import RunKind, Runs, ThreadStopDelivery
from monarch_kernel.rank.user_threads import UserThreads
from monarch_kernel.wire.actor_messages import CONTROLLER
from monarch_kernel.wire.calls import CallKey, PendingCall, set_default_sender
from monarch_kernel.wire.lanes import actor_lane_path
from monarch_kernel.wire.messages import ActorCall, ActorReply, CancelCall, Failure, FailureCause
from monarch_kernel.wire.ops import ConstructorFailed, SpawnRefused

WAIT_CHECK_S = 0.5  # how often a wait looks again for a deadlock, at most


class ActorHost:
    """Instances and mailboxes of the actors on one rank."""

    def __init__(self, rank: int, send: Callable[[Any], None], shm_dir: str | None, ops: RankOps,
                 interrupts: MainThreadInterrupts, threads: UserThreads, mesh: str = ""):
        self.rank = rank
        self.mesh_name = mesh
        self._lane_dir = shm_dir  # where this rank's lanes listen (an async actor's own ones too); None: no lanes
        self._lock = threading.Lock()  # guards the mailboxes and their queues, and the calls' state below
        self._mailboxes = Mailboxes(self._lock)
        self.instances = self._mailboxes.instances  # what `actors[...]` shows in %%mesh cells
        self._tasks: dict[CallKey, asyncio.Task] = {}
        self.order = BehindRequests()  # the notebook's calls wait for its requests before them
        self.runs = Runs(ThreadStopDelivery(interrupts, self.notify))  # the rank's work and its stops (rank/runs.py)
        self.doing = EndpointActivity(self.runs)  # what the heartbeat tells the agent (its on_idle: set by the rank)
        self.replies = CallReplies(rank, send, shm_dir, self.runs)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0  # the thread that runs the loop
        self.threads = threads  # where a sync endpoint runs: the main thread when free, else its actor's own
        self._inbox: deque[tuple[ActorCall, Any]] = deque()  # (call, reply route) in arrival order, for the loop
        self._wake = threading.Condition()  # a call or a reply arrived (for the waits)
        self._graph = WaitGraph(self.runs)
        self._main = threading.main_thread().ident or 0
        self.sender = RankSender(rank, send, shm_dir, self.wait_for, self.notify, self.replies.through_port, mesh)
        self.sender._post_local = self.post_local
        self.failures = ActorFailures(rank, self._lock, self._mailboxes, self.replies, self.sender, self.runs,
                                      self._stop_runs, self._end)
        set_default_sender(self.sender)
        ops.serve_actors(self)
        self._mailboxes.add_system(Mailbox(SYSTEM_ACTOR, SYSTEM_ACTOR, SystemActor(ops), Shape((), (rank,)), Point((), 0)))

    def run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver calls and run async endpoints on `loop`, in the calling thread (the rank's loop thread)."""
        self.loop, self._loop_thread = loop, threading.get_ident()
        asyncio.set_event_loop(loop)
        set_rank_loop(loop)
        loop.run_forever()

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the rank's event loop (any thread)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def spawn(self, name: str, key: str, cls: type, args: tuple, kwargs: dict, shape: Shape,
              sources: dict[str, list[str]], creator: ActorIdentity | None = None,
              supervise_constructor: bool = False,
              outcome_port: tuple[int, int, str] | None = None) -> str | ConstructorFailed | SpawnRefused:
        """Create this rank's instance of actor mesh `name` (in user-code context); `key` names this spawn.

        An earlier actor mesh of that name here is replaced, as re-running a notebook cell expects: its
        queued calls fail, and calls through its old handle say that it was spawned again. With
        `supervise_constructor` (Monarch's ProcMesh.spawn) a constructor that raises an Exception leaves a
        failed actor here, which answers every call with that failure, and the answer says what it raised; and
        a process where an actor failed before takes none (`SpawnRefused`: Monarch's poisoned process).
        With `outcome_port` too (Monarch's spawn, which does not wait for constructors) it answers at once: see
        `_spawn_then_construct`."""
        if supervise_constructor and self.failures.first:
            return SpawnRefused(self.rank, self.failures.first)
        for filename, lines in sources.items():
            linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
        point = shape.numbered_point(self.rank) or Point((), 0)
        spawner = creator or root_identity()
        slot = name if spawner.creator is None else f"{spawner.qualified_name()}\n{name}"  # (no name holds a newline)
        register_identity(key, ActorIdentity(name, f"{cls.__module__}.{cls.__qualname__}", point, self.mesh_name,
                                             shape, spawner))
        install_log_prefix()  # (with the rank's first actor: records its actors log name them, as Monarch's)
        if outcome_port is not None:
            return self._spawn_then_construct(Mailbox(name, key, None, shape, point, slot=slot, busy=True), cls, args,
                                              kwargs, Port(*outcome_port))
        token, owner = current_point.set(point), current_actor.set(key)
        own_loop: ActorLoop | None = None
        try:
            own_loop = ActorLoop(key) if serves_async(cls) else None
            instance = construct(cls, args, kwargs, *self._loop_of(own_loop))
        except Exception as exc:
            forget_identity(key)
            if own_loop is not None:
                own_loop.close()
            if not supervise_constructor:
                raise
            failure, failed = self._constructor_failure(name, cls, exc)
            self._add(Mailbox(name, key, None, shape, point, slot=slot, failed=failed))
            self.failures.note(failed)
            return failure
        except BaseException:
            forget_identity(key)
            if own_loop is not None:
                own_loop.close()
            raise
        finally:
            current_point.reset(token)
            current_actor.reset(owner)
        self._add(Mailbox(name, key, instance, shape, point, slot=slot, own_loop=own_loop))
        return f"{cls.__name__} on rank {self.rank}"

    def _spawn_then_construct(self, box: Mailbox, cls: type, args: tuple, kwargs: dict, outcome: Port[Any]) -> str:
        """Monarch's spawn: `box` (busy, with no instance yet) is here from now on, so calls that come wait in it.
        An async actor's constructor runs on the actor's own event loop after the answer, so one that never returns
        holds only its own actor; a sync actor's runs here first. How it ended goes through `outcome`."""
        box.own_loop = ActorLoop(box.key) if serves_async(cls) else None
        self._add(box)
        job = functools.partial(self._construct, box, cls, args, kwargs, outcome)
        if box.own_loop is not None:
            box.own_loop.loop.call_soon_threadsafe(job)
        else:  # a sync actor is made here, as before the answer: on the thread where its sync endpoints run when
            job()  # they can (the main thread, when free), so thread-local state its __init__ sets is theirs
        return f"{cls.__name__} on rank {self.rank}"

    def _construct(self, box: Mailbox, cls: type, args: tuple, kwargs: dict, outcome: Port[Any]) -> None:
        """Make the instance of `box` (on its thread or loop), then serve the calls that waited for it."""
        try:
            instance = context_at(box.point, box.key).run(cls, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - a stop too: the actor has no instance, it failed
            self._constructor_failed(box, cls, exc, outcome)
            return
        with self._lock:
            if not box.stopped:
                box.instance = instance
                self._mailboxes.instances[box.name] = instance
        _send_outcome(outcome, f"{cls.__name__} on rank {self.rank}")
        if box.stopped:  # stopped while its constructor ran: nothing runs on it
            if box.own_loop is not None:
                box.own_loop.close()
            return
        with self._lock:
            box.busy = False
        self._drain(box)

    def _constructor_failed(self, box: Mailbox, cls: type, exc: BaseException, outcome: Port[Any]) -> None:
        """The constructor of `box` raised: the actor stays failed here (every call is answered with the failure),
        the calls that waited are answered now, and the client hears what it raised."""
        failure, failed = self._constructor_failure(box.name, cls, exc)
        with self._lock:
            box.failed = failed
            queued = list(box.queue)
            box.queue.clear()
            box.busy = False
        for msg in queued:
            self.replies.reply(msg, None, failed)
        forget_identity(box.key)
        if box.own_loop is not None:
            box.own_loop.close()
        if not box.stopped:
            self.failures.note(failed)
        _send_outcome(outcome, failure)

    def _constructor_failure(self, name: str, cls: type, exc: BaseException) -> tuple[ConstructorFailed, Failure]:
        """What the spawner hears of a constructor that raised, and what calls to that actor are answered with."""
        shown = "".join(traceback.format_exception(type(exc), exc, constructor_traceback(exc.__traceback__, __file__)))
        failure = ConstructorFailed(self.rank, type(exc).__name__, str(exc), shown)
        return failure, Failure.of(FailureCause.ACTOR_FAILED, f"actor {name!r} ({cls.__name__}) on rank {self.rank} "
                                   f"failed: its constructor raised {failure.error_type}: {failure.message}\n"
                                   f"{failure.traceback.rstrip()}")

    def _add(self, box: Mailbox) -> None:
        self.stop(box.slot, replaced=True)
        if box.own_loop is not None and self._lane_dir:  # other meshes' ranks here call it on its own loop
            try:  # (its loop keeps it: the lanes' retirement is among what runs as the loop ends)
                ActorLanes(actor_lane_path(self._lane_dir, self.rank, box.key), box.own_loop, self._on_lane_message,
                           lambda: (self.loop, self._loop_thread))
            except OSError:  # (then they call it by the rank's lane, as a sync actor)
                pass
        with self._lock:
            self._mailboxes.add(box)

    def _on_lane_message(self, msg: Any, reply: Callable[[Any], None]) -> None:
        """A message on an async actor's own lane (its loop): a call, answered on that lane, or a call's cancel."""
        if isinstance(msg, ActorCall):
            self.deliver(msg, reply)
        elif isinstance(msg, CancelCall):
            self.cancel(msg)

    def fail_key(self, key: str, report: str) -> bool:
        """The actor of spawn `key` here fails: an owned failure was not handled (see ActorFailures.fail_key)."""
        return self.failures.fail_key(key, report)

    def meshes(self) -> list[tuple[str, str, Any, Shape]]:
        """The actor meshes here: (name, spawn key, this rank's instance, shape)."""
        return [(box.name, box.key, box.instance, box.shape) for box in self._mailboxes.current()
                if box.failed is None and box.instance is not None]

    def stop_key(self, key: str) -> bool:
        """Stop the actors of one spawn (by key) on this rank; False if it is not (or no longer) here."""
        slot = self._mailboxes.is_current(key)
        if slot is not None:
            self.stop(slot)
        return slot is not None

    def stop(self, slot: str, *, replaced: bool = False) -> None:
        """Forget the current actor mesh of `slot` (its name, for the notebook's) on this rank (its queued
        calls fail), then end its instance: its concurrent endpoints' tasks are cancelled, then its
        `__cleanup__(None)` runs, as in Monarch."""
        with self._lock:
            removed = self._mailboxes.remove(slot, replaced)
        if removed is None:
            return
        box, queued = removed
        name = box.name
        self.threads.end(box.key)
        why = Failure.of(FailureCause.ACTOR_REPLACED, f"actor mesh {name!r} was spawned again") if replaced else \
            Failure.of(FailureCause.ACTOR_STOPPED, f"actor mesh {name!r} was stopped")
        for msg in queued:
            self.replies.reply(msg, None, why)
        if box.failed is None:  # (a failed actor was ended as it failed)
            self._end(box)
        forget_identity(box.key)

    def stop_all(self) -> int:
        """Stop every actor mesh on this rank (its processes are about to end): how many there were."""
        slots = [box.slot or box.name for box in self._mailboxes.current()]
        for slot in slots:
            self.stop(slot)
        return len(slots)

    def _end(self, box: Mailbox, error: BaseException | None = None) -> None:
        """End a stopped or failed actor: what it spawned or started goes first (Monarch's recursive stop), then
        the actor itself (`rank/actor_instances.py`)."""
        stop_owned(box.key)
        loop, loop_thread = self._loop_of(box.own_loop)
        try:
            end_instance(box, error, rank=self.rank, lock=self._lock, loop=loop, loop_thread=loop_thread)
        finally:
            if box.own_loop is not None:
                box.own_loop.close()

    def _loop_of(self, own_loop: ActorLoop | None) -> tuple[asyncio.AbstractEventLoop | None, int]:
        """(loop, its thread) where an actor's async code runs: its own loop, else the rank's (the system actor)."""
        return (own_loop.loop, own_loop.ident) if own_loop is not None else (self.loop, self._loop_thread)


    # ------------------------------------------------------------ reader thread side
    def cancel(self, msg: CancelCall) -> None:
        """Called by the reader thread: stop a call wherever it is."""
        self._stop_runs([(msg.caller, msg.call_id)])

    def _stop_runs(self, keys: list[CallKey]) -> None:
        """Stop these calls wherever they run: a sync one where its thread is, an async one's task cancelled."""
        self.runs.stop(keys)
        with self._lock:
            tasks = [task for key in keys if (task := self._tasks.get(key)) is not None]
        for task in tasks:
            with contextlib.suppress(RuntimeError):  # (its loop closed: the task ended with its actor)
                task.get_loop().call_soon_threadsafe(task.cancel)

    def arrived(self, msg: ActorCall) -> None:
        """A call from the agent (the reader thread). The notebook's go through the loop, in order with
        its requests (`deliver`); the others go straight to their mailbox from here (one hop fewer)."""
        if msg.caller == CONTROLLER:
            self._inbox.append((msg, None))
            self.notify()  # (a wait on the loop thread delivers it)
            self.on_loop(self.pump)
        else:
            self._deliver_now(msg, None)

    def post_local(self, msg: ActorCall) -> None:
        """A call from this rank to its own actors: no trip through the agent, the reply comes back here.
        It goes straight into the mailbox: a caller that waits on it serves it itself if the actor is
        idle (`wait_for`), else the loop starts it."""
        self._deliver_now(msg, self._local_reply, start=False)

    def _local_reply(self, reply: ActorReply) -> None:
        self.sender.calls.deliver(reply)
        self.notify()

    def notify(self) -> None:
        """A call or a reply arrived: wake the threads that wait on actor calls (`wait_for`)."""
        with self._wake:
            self._wake.notify_all()

    # ------------------------------------------------------------ loop side
    def pump(self) -> None:
        """Deliver the calls that arrived, in order (the loop thread)."""
        while self._inbox:
            self.deliver(*self._inbox.popleft())

    def wait_for(self, ready: Callable[[], bool], timeout: float | None, pending: PendingCall | None) -> bool:
        """Wait until ready() (replies to `pending`, or a port's message), any thread. Raises
        ActorDeadlockError when a wait on `pending` could never end (see `rank/deadlocks.py`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        on_loop = threading.get_ident() == self._loop_thread
        box: Mailbox | None = (self._mailboxes.get(pending.actor)
                               if pending is not None and self.rank in pending.outstanding else None)
        waited_before = self._graph.waits_on(box)
        in_request = threading.get_ident() == self._main and self.order.running
        if in_request:  # (what it waits on may be among the notebook's calls held behind it)
            self.order.request_waits(True)
            self.on_loop(self.release_held)
        try:
            while True:
                if ready():
                    return True
                if box is not None and not box.busy and box.queue:
                    with self.runs.rank_code():  # (a stop of the run that waits is raised in the call's code, not here)
                        if (msg := self._claim(box)) is not None:
                            self._serve_claimed(box, msg)  # (this thread would only wait: it serves the call itself)
                    continue
                if box is not None and pending is not None and box.busy:
                    if box.key == SYSTEM_ACTOR and self._graph.runs_here(box):
                        with self.runs.rank_code():
                            self._serve_inline(box)  # a spawn inside a spawn (an actor's constructor spawns)
                        continue
                    self._graph.check(self.rank, box, pending.label, self._loop_of(box.own_loop)[1])
                if on_loop and self._inbox:  # (the loop waits here: it delivers meanwhile)
                    self.pump()
                    continue
                with self._wake:
                    if (on_loop and self._inbox) or ready():
                        continue
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._wake.wait(WAIT_CHECK_S if remaining is None else min(remaining, WAIT_CHECK_S))
        finally:
            self._graph.waits_on(waited_before)
            if in_request:
                self.order.request_waits(False)

    def deliver(self, msg: ActorCall, reply_via: Callable[[Any], None] | None = None) -> None:
        """Queue a call on its actor's mailbox and serve the mailbox if idle (the loop thread, or an async
        actor's own loop for a call on its own lane), unless the notebook sent it after a request not yet
        ended here (`rank/call_order.py`: the notebook never calls by an actor's own lane).

        The answer goes back the way the call came: `reply_via` (a direct lane) or the agent.
        """
        if not self.order.hold(msg, reply_via):
            self._deliver_now(msg, reply_via)

    def release_held(self) -> None:
        """Deliver the notebook's calls that waited for its requests, if they may go now (the loop thread)."""
        for msg, reply_via in self.order.release():
            self._deliver_now(msg, reply_via)

    def _deliver_now(self, msg: ActorCall, reply_via: Callable[[Any], None] | None, start: bool = True) -> None:
        if reply_via is not None:
            self.replies.came_by(msg, reply_via)
        with self._lock:
            box = self._mailboxes.get(msg.actor)
            beside = box is not None and msg.endpoint == SUPERVISE and not box.stopped and box.failed is None and \
                (found := box.endpoint(SUPERVISE)) is not None and found[4]
            if box is not None and not box.stopped and box.failed is None and not beside:
                box.queue.append(msg)
        if beside and box is not None:  # an async actor's __supervise__ runs at once, beside its endpoints
            started = self._start(box, msg)
            if started is not None:
                self._launch_async(box, msg, started, beside=True)
            return
        if box is not None and box.failed is not None:
            self.replies.reply(msg, None, box.failed)
            return
        if box is None or box.stopped:
            self.replies.reply(msg, None, self._mailboxes.not_here(self.rank, msg.actor))
            return
        if not box.busy:
            self._drain(box) if start else self.on_loop(self._drain, box)
        elif box.key == SYSTEM_ACTOR:
            self.notify()  # (its call may wait on this one: it serves it inline)

    def _claim(self, box: Mailbox) -> ActorCall | None:
        """The next call of an idle mailbox, which is busy from now on (None: busy, or nothing queued)."""
        with self._lock:
            if not box.queue or box.busy:
                return None
            box.busy = True
            return box.queue.popleft()

    def _drain(self, box: Mailbox) -> None:
        while (msg := self._claim(box)) is not None:
            started = self._start(box, msg)
            if started is None:
                box.busy = False
            elif started[0]:
                self._launch_async(box, msg, started)
            else:  # its next call waits for it to end, on whichever thread it runs
                job = functools.partial(self._serve_then_next, box, msg, *started[1:])
                self.threads.place(box.key, job)

    def _launch_async(self, box: Mailbox, msg: ActorCall, started: tuple, beside: bool = False) -> None:
        """Run an async endpoint as a task on its actor's loop (from any thread); `box` is busy until it ends,
        except for a concurrent endpoint's call: the mailbox goes on to its next call once it started.
        `beside`: a call that never took the mailbox (an async actor's __supervise__), which it leaves as is."""
        loop, loop_thread = self._loop_of(box.own_loop)
        assert loop is not None, "async endpoints need an event loop"
        concurrent = box.endpoints[msg.endpoint][4]
        if not beside:
            box.in_async = not concurrent
        if threading.get_ident() != loop_thread:
            try:
                loop.call_soon_threadsafe(self._launch_async, box, msg, started, beside)
            except RuntimeError:  # its loop closed: the actor ended meanwhile
                self.replies.reply(msg, None, box.failed or self._mailboxes.not_here(self.rank, msg.actor))
            return
        task = loop.create_task(self._serve_async(box, msg, *started[1:], concurrent=concurrent or beside),
                                     context=context_at(point_of(box, msg), box.key))
        with self._lock:
            self._tasks[(msg.caller, msg.call_id)] = task
            if concurrent or beside:
                box.tasks.add(task)
            if concurrent and not beside:
                box.busy = False
        if concurrent and not beside:
            self.on_loop(self._drain, box)  # (the calls queued behind it go on now)

    def _start(self, box: Mailbox, msg: ActorCall) -> tuple[bool, Any, str, tuple, dict] | None:
        """(is async, method, label, args, kwargs) of a call to run; None if it was answered already."""
        key = (msg.caller, msg.call_id)
        if self.runs.stopped(key):
            self.replies.reply(msg, None, Failure("KeyboardInterrupt", "cancelled before it started", "", interrupted=True))
            return None
        prepared = prepare_call(box, msg, self.rank)
        if isinstance(prepared, Failure):
            self.replies.reply(msg, None, prepared)
            return None
        if box.endpoints[msg.endpoint][3] and not msg.to_port:  # it answers through its port, now or later
            self.replies.expect_port_answer(msg)
        return prepared

    def _serve_then_next(self, box: Mailbox, msg: ActorCall, *call: Any) -> None:
        """Serve a sync call, then the actor's next ones on this same thread while they are sync (no
        trip through the loop per call); the main thread goes on only while nothing else waits for it."""
        while True:
            method, label, args, kwargs = call
            self._serve_sync(box, msg, method, label, args, kwargs, job=True)
            following = self._follow(box)
            if following is None:
                return
            msg, started = following
            if started[0]:  # async: the loop runs it (the mailbox stays busy)
                self._launch_async(box, msg, started)
                return
            call = started[1:]

    def _follow(self, box: Mailbox) -> tuple[ActorCall, tuple] | None:
        """The next call of `box`, whose call just ended on this thread, to run here; None: the mailbox
        is idle again (and the loop serves what is queued, if this thread may not: an actor's own thread
        leaves it to the main thread when that is free)."""
        on_main = threading.get_ident() == self._main
        while True:
            with self._lock:
                threads = self.threads
                may = bool(box.queue) and not box.stopped and (threads.keep() if on_main else not threads.idle())
                msg = box.queue.popleft() if may else None
                if msg is None:
                    box.busy = False
                    left = bool(box.queue) and not box.stopped
            if msg is None:
                if left:
                    self.on_loop(self._drain, box)
                return None
            started = self._start(box, msg)
            if started is not None:
                return msg, started

    def _serve_claimed(self, box: Mailbox, msg: ActorCall) -> None:
        """Serve a call claimed by a thread that waits on its actor (inside that wait)."""
        started = self._start(box, msg)
        if started is not None and started[0]:
            self._launch_async(box, msg, started)
            return
        if started is not None:
            self._serve_sync(box, msg, *started[1:])
        with self._lock:
            box.busy = False
            left = bool(box.queue) and not box.stopped
        if left:
            self.on_loop(self._drain, box)

    def _serve_inline(self, box: Mailbox) -> None:
        """Serve the calls queued for `box`, which this thread serves and waits on (the system actor)."""
        while box.queue:
            with self._lock:
                msg = box.queue.popleft() if box.queue else None
            if msg is not None and (started := self._start(box, msg)) is not None:
                self._serve_sync(box, msg, *started[1:])

    def _serve_sync(self, box: Mailbox, msg: ActorCall, method, label: str, args, kwargs, job: bool = False) -> None:
        """Run a sync call on this thread and answer it; `job`: as a job of its own (not inside a wait)."""
        key = (msg.caller, msg.call_id)  # (a stop that came after the mailbox's check raises as its user code starts)
        token, owner = current_point.set(point_of(box, msg)), current_actor.set(box.key)
        started = time.perf_counter()
        heard: Future[Any] | None = None
        run = self.runs.begin(key, RunKind.ENDPOINT, label, actor=box)
        try:
            value, failure = self.runs.user_code(run, method, *args, **kwargs), None
        except BaseException as exc:  # noqa: BLE001 - every endpoint error goes to its caller
            value, failure = None, describe_failure(exc)
            self.runs.failed(run, exc)
            if not failure.interrupted and self.runs.ended_by_its_stop(run):
                failure = dataclasses.replace(failure, interrupted=True)  # (the stop's doing, not the endpoint's)
            if self.failures.ends_the_actor(box, msg, exc, failure):
                failure, heard = self.failures.fail(box, msg, exc, failure)
            elif failure.interrupted and box.failed is not None:  # (stopped as its actor failed)
                failure = box.failed
        finally:
            self.runs.end(run)
            current_point.reset(token)
            current_actor.reset(owner)
        if job and threading.get_ident() == self._main:
            self.threads.release()  # (the caller may call again as soon as it has the reply: main is free)
        self.failures.answer(box, msg, value, failure, time.perf_counter() - started, heard)

    async def _serve_async(self, box: Mailbox, msg: ActorCall, method, label: str, args, kwargs, *,
                           concurrent: bool = False) -> None:
        started = time.perf_counter()
        key = (msg.caller, msg.call_id)
        heard: Future[Any] | None = None
        run = self.runs.begin(key, RunKind.ENDPOINT, label, actor=box, task=True)
        try:
            value, failure = await method(*args, **kwargs), None
        except asyncio.CancelledError:
            value, failure = None, box.failed or Failure("KeyboardInterrupt", "cancelled while it ran", "",
                                                         interrupted=True)
        except BaseException as exc:  # noqa: BLE001
            value, failure = None, describe_failure(exc)
            if self.failures.ends_the_actor(box, msg, exc, failure):
                failure, heard = self.failures.fail(box, msg, exc, failure)
        with self._lock:
            task = self._tasks.pop(key, None)
            box.tasks.discard(task)
        self.runs.end(run)
        self.failures.answer(box, msg, value, failure, time.perf_counter() - started, heard)
        if concurrent:
            return  # (it never held the mailbox)
        with self._lock:
            box.busy = box.in_async = False
        self._drain(box)


def _send_outcome(outcome: Port[Any], value: str | ConstructorFailed) -> None:
    """Tell the spawning client how a constructor ended (it may have gone: then nobody is told)."""
    with contextlib.suppress(Exception):
        outcome.send(value)
