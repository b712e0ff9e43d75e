"""The work a rank runs for others, and the one way a stop reaches it.

A *run* is one piece of work sent to this rank: a request of the notebook (a cell, a pull, a push, an
operation, a call: keyed by its `req_id`) or an actor call (keyed by its `(caller, call_id)`). A run is
begun on the thread that runs it, enters and leaves its user code (a request may do so more than once:
an autoreload check, then the cell), and ends. A stop names runs, never threads:

- a stop for a run whose user code runs now reaches the thread it runs on: SIGINT on the main thread
  (`rank/interrupts.py`: raised only while that run is current there), an asynchronous
  KeyboardInterrupt on any other thread (`rank/thread_stops.py`); a collective that thread waits in,
  which neither reaches, is ended, and the run's answer says so;
- a stop for a run that has not reached its user code yet (a stop may overtake its request, or come
  while the rank's own code runs for it) is owed: raised as its user code is entered or resumed;
- a stop for a run that has ended is dropped: it never lands in whatever runs next;
- `stop(running=True)` stops every run inside its user code now (the notebook's stop button); when
  no user code runs, it does nothing.

Nested runs: a run's user code may wait on an actor of its own rank, and that wait may serve the call
itself on the same thread (`ActorHost.wait_for`). Each thread keeps a stack of its runs, innermost last:
the call served is a run of its own on top, and the rank's code that serves it holds the run below
(`Runs.rank_code`). A stop of the outer run reaches whatever user code is on top of its thread's stack,
the inner call's included (the outer run waits on it, or cannot go on until it ends), but never the
rank's code between them: there it is owed, and delivered as user code resumes. A stop of the inner run
reaches only it. Async endpoints are runs too (tasks of the rank's loop, on no stack: a stop cancels
their task); with the sync calls on the stacks, they are what the heartbeat reports
(`rank/activity.py`) and what the deadlock check follows (`rank/deadlocks.py`).

Threads and locks (the rank's whole stop machinery; `rank/__init__.py` lists the rank's threads):
`Runs._lock` guards the runs begun, their stacks and fields, the keys stopped and the collectives'
endings. Each stack is changed only by its own thread, under the lock; others read it under the lock,
and the SIGINT handler (which may run at any line of the main thread) reads the main thread's own
stack without it (`Runs.current`, one list read per run). Under `Runs._lock` a stop may take
`MainThreadInterrupts._lock`, then `core.interrupt_shield._lock` (a leaf), wake the actors' waits
(`ActorHost._wake`, a leaf) and end a collective (`collectives`: socket shutdowns, no lock of ours).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from monarch_kernel.rank import collectives
from monarch_kernel.rank.interrupts import MainThreadInterrupts
from monarch_kernel.rank.recent import RecentKeys
from monarch_kernel.rank.thread_stops import stop_thread, withdraw_stop
from monarch_kernel.wire.calls import CallKey

T = TypeVar("T")
RunKey = int | CallKey  # a request's req_id, or an actor call's (caller, call_id)


class RunKind(enum.Enum):
    """What a run is: a request of the notebook (on the main thread, in order) or an actor call."""

    REQUEST = "request"
    ENDPOINT = "endpoint"


class Run:
    """One piece of work on this rank, from `Runs.begin` to `Runs.end`."""

    __slots__ = ("key", "kind", "label", "thread", "actor", "started", "depth", "held", "entered", "ended", "owed",
                 "sent", "reached")

    def __init__(self, key: RunKey, kind: RunKind, label: str, thread: int, actor: Any = None) -> None:
        self.key = key
        self.kind = kind
        self.label = label  # how a hang report names it ("In[7]", "Trainer.step")
        self.thread = thread  # the thread that runs it (an async endpoint's: the rank's loop)
        self.actor = actor  # the mailbox of the actor whose call it is (None: a request)
        self.started = time.monotonic()
        self.depth = 0  # its user-code sections open now (0: the rank's own code runs for it)
        self.held = 0  # rank code running inside its user code now (`Runs.rank_code`): not to be stopped there
        self.entered = False  # its user code has started at least once
        self.ended = False
        self.owed = False  # stopped when no user code of its ran on top: raised as its user code runs again
        self.sent = False  # an asynchronous stop was sent to its thread and not raised yet (not the main thread)
        self.reached = False  # a stop was sent to its thread for it

    def alive(self) -> bool:
        """Not ended yet (lock-free: the SIGINT handler asks)."""
        return not self.ended

    def __repr__(self) -> str:
        return f"Run({self.kind.value} {self.key!r} {self.label!r}, thread {self.thread}, depth {self.depth})"


class StopDelivery(Protocol):
    """How a stop reaches a thread (the rank's real one is `ThreadStopDelivery`; tests use fakes)."""

    main_thread: int

    def to_main_thread(self, alive: Callable[[], bool], current: Callable[[], bool]) -> None:
        """SIGINT the main thread until the run (`alive`) is current there (`current`) and the handler raised."""

    def to_thread(self, thread: int) -> None:
        """An asynchronous KeyboardInterrupt in `thread` at its next line."""

    def withdraw(self, thread: int) -> None:
        """Forget a stop sent to `thread` and not raised yet (what it was for has ended)."""

    def end_collective(self, thread: int) -> str:
        """End the collective `thread` waits in: how ("" if it waits in none)."""


class Runs:
    """The runs begun on this rank and the stops addressed to them; one lock (see the module's note)."""

    def __init__(self, delivery: StopDelivery) -> None:
        self._delivery = delivery
        self._lock = threading.Lock()
        self._begun: dict[RunKey, Run] = {}
        self._stacks: dict[int, list[Run]] = {}  # thread -> its runs, innermost last
        self._stopped = RecentKeys()  # (a stop may come before its run; the oldest are forgotten)
        self._aborted: dict[RunKey, str] = {}  # runs whose collective a stop ended (or a peer's), and how
        self.broken_by_peer: Callable[[BaseException], str] = lambda exc: ""  # a collective's error: how it broke
        self.on_ended: Callable[[Run], None] | None = None  # told of each run that ended (after the lock)
        # told at once (after the lock) when a stop ends the collective a run waits in: the notebook then knows
        # that run will answer, however long a loaded machine takes to unwind it, and to make the group anew
        self.on_collective_ended: Callable[[RunKey, str], None] | None = None

    # ------------------------------------------------------------ the threads that run the work
    def begin(self, key: RunKey, kind: RunKind, label: str = "", thread: int | None = None, actor: Any = None,
              *, task: bool = False) -> Run:
        """Run `key` starts on the calling thread (tests: `thread`); its user code runs in `user_code`.
        `actor`: the mailbox whose call it is; `task`: an async endpoint, a task of the rank's loop (it
        takes no thread's stack: tasks interleave; a stop cancels it, see `ActorHost.cancel`)."""
        run = Run(key, kind, label, threading.get_ident() if thread is None else thread, actor)
        with self._lock:
            self._begun[key] = run
            if not task:
                self._stacks.setdefault(run.thread, []).append(run)
        return run

    def end(self, run: Run) -> None:
        """The run has ended on its thread: a stop for it is dropped from now on."""
        with self._lock:
            run.ended = True
            if self._begun.get(run.key) is run:
                del self._begun[run.key]
            stack = self._stacks.get(run.thread)
            if stack is not None and run in stack:
                stack.remove(run)
                if not stack:
                    del self._stacks[run.thread]
                else:
                    self._deliver_owed(stack)  # (back in the user code of the run below it, if any)
        if self.on_ended is not None:
            self.on_ended(run)

    def user_code(self, run: Run, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) as the run's user code: a stop of the run raises KeyboardInterrupt in it
        (one that came before raises as it starts), and never once it has returned."""
        entered = False
        try:
            entered, owed_below = self._enter(run)
            if owed_below:  # (a stop owed to a run whose wait this serves: raised here, now)
                self._deliver_below(run)
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            if entered:
                self._raised(run.thread)
            raise
        finally:
            if entered:
                try:
                    self._leave(run)
                except KeyboardInterrupt:  # (it came as fn ended: raised again once the books are right)
                    self._surely(self._leave, run, stopped=True)

    def rank_code(self, thread: int | None = None) -> _RankCode:
        """The rank's own code inside a run's user code on this thread (a wait serving a call itself), as a
        `with` block: a stop of that run is not raised in it; it is owed, and raised as user code runs again."""
        return _RankCode(self, thread)

    def _hold(self, thread: int) -> Run | None:
        with self._lock:
            stack = self._stacks.get(thread)
            if not stack:
                return None  # (no run's user code below: nothing to hold)
            top = stack[-1]
            top.held += 1
            return top

    def _release(self, run: Run) -> None:
        with self._lock:
            if run.held > 0:
                run.held -= 1
                if run.held == 0:
                    self._deliver_owed(self._stacks.get(run.thread, []))

    def _surely(self, bookkeeping: Callable[[Run], object], run: Run, stopped: bool = False) -> None:
        """bookkeeping(run), whole even if a stop lands in it (it is idempotent); such a stop came as the code
        before it ended, and is raised once the books are right (never lost, never raised twice)."""
        while True:
            try:
                bookkeeping(run)
                break
            except KeyboardInterrupt:
                stopped = True
        if stopped:
            self._raised(run.thread)
            raise KeyboardInterrupt

    def _enter(self, run: Run) -> tuple[bool, bool]:
        """(entered, whether a run below it on its thread is owed a stop)."""
        with self._lock:
            if run.owed or (not run.entered and run.key in self._stopped):
                run.owed = False
                raise KeyboardInterrupt("stopped before it started on this rank")
            run.depth += 1
            run.entered = True
            return True, any(below.owed for below in self._stacks.get(run.thread, ()))

    def _deliver_below(self, run: Run) -> None:
        with self._lock:
            self._deliver_owed(self._stacks.get(run.thread, []))

    def _leave(self, run: Run) -> None:
        with self._lock:
            if run.depth > 0:
                run.depth -= 1
                if run.depth == 0 and run.thread != self._delivery.main_thread:
                    self._delivery.withdraw(run.thread)  # (a stop sent and not raised: owed again, below)
                    for other in self._stacks.get(run.thread, []):
                        if other.sent:
                            other.sent, other.owed = False, other is not run

    def _raised(self, thread: int) -> None:
        """A KeyboardInterrupt came out of user code on `thread`: the stops sent there are spent."""
        with self._lock:
            for run in self._stacks.get(thread, []):
                run.sent = run.owed = False

    def failed(self, run: Run, exc: BaseException) -> None:
        """The run raised `exc`: if inside a collective that a peer's stop ended (before this rank's stop came),
        its answer says the collective was ended, as a rank whose stop came first says."""
        how = self.broken_by_peer(exc)
        if how:
            with self._lock:
                self._aborted.setdefault(run.key, how)

    def ended_by_its_stop(self, run: Run) -> bool:
        """Whether the run's stop ended a collective it waited in: it failed of that, whether or not the
        KeyboardInterrupt came before its user code ended (on a loaded machine the signal may be late)."""
        with self._lock:
            return run.reached and run.key in self._aborted

    def answered(self, key: RunKey) -> str:
        """The run's answer goes out: forget its stop; how its collective was ended ("" if it was not)."""
        with self._lock:
            self._stopped.discard(key)
            return self._aborted.pop(key, "")

    # ------------------------------------------------------------ stops (the reader thread, any thread)
    def stop(self, keys: Iterable[RunKey] = (), *, running: bool = False) -> None:
        """Stop the runs `keys` (now if their user code runs, else as it runs again; ended ones: never);
        with `running`, also every run inside its user code now."""
        with self._lock:
            targets: dict[RunKey, Run] = {}
            for key in keys:
                self._stopped.add(key)
                run = self._begun.get(key)
                if run is not None:
                    targets[key] = run
            if running:
                for key, run in self._begun.items():
                    if run.depth > 0:
                        self._stopped.add(key)
                        targets[key] = run
            ended: list[tuple[RunKey, str]] = []
            for run in targets.values():
                if self.current(run):
                    if how := self._reach(run):
                        ended.append((run.key, how))
                elif run.entered:  # (not entered yet: `_enter` sees it in the keys stopped)
                    run.owed = True
        if self.on_collective_ended is not None:
            for key, how in ended:
                self.on_collective_ended(key, how)

    def stopped(self, key: RunKey) -> bool:
        """Whether run `key` was told to stop."""
        with self._lock:
            return key in self._stopped

    def current(self, run: Run) -> bool:
        """Whether a stop of `run` may be raised on its thread now: user code is on top of the thread's stack
        (its own, or a call its wait serves there), and `run` is in that stack (lock-free, see the note)."""
        stack = self._stacks.get(run.thread)
        if not stack or run.ended:
            return False
        top = stack[-1]
        return top.depth > 0 and not top.held and not top.ended and run in stack

    def _reach(self, run: Run) -> str:
        run.reached = True
        delivery = self._delivery
        if run.thread == delivery.main_thread:
            delivery.to_main_thread(run.alive, lambda: self.current(run))
        else:
            run.sent = True
            delivery.to_thread(run.thread)
        ended = delivery.end_collective(run.thread)
        if ended:  # (a signal cannot reach into a collective's wait: it was ended; the run's answer says so)
            self._aborted[run.key] = ended
        return ended

    def _deliver_owed(self, stack: list[Run]) -> None:
        for run in stack:
            if run.owed and self.current(run):
                run.owed = False
                self._reach(run)

    # ------------------------------------------------------------ what runs now
    def calls(self) -> list[Run]:
        """The actor calls running now (sync and async), oldest first."""
        with self._lock:
            return sorted((run for run in self._begun.values() if run.actor is not None), key=lambda run: run.started)

    def calls_by_thread(self) -> dict[int, list[Run]]:
        """The sync actor calls each thread runs, outermost first (a thread may serve a call inside its wait)."""
        with self._lock:
            found = {thread: [run for run in stack if run.actor is not None] for thread, stack in self._stacks.items()}
        return {thread: calls for thread, calls in found.items() if calls}

    def user_code_on(self, thread: int) -> bool:
        """Whether user code of some run executes on `thread` now."""
        with self._lock:
            stack = self._stacks.get(thread)
            return bool(stack) and stack[-1].depth > 0 and not stack[-1].held  # type: ignore[index]


class _RankCode:
    """`Runs.rank_code`'s block: the run on top of the thread's stack is held (not stopped) while it lasts."""

    __slots__ = ("_runs", "_thread", "_held")

    def __init__(self, runs: Runs, thread: int | None) -> None:
        self._runs, self._thread = runs, thread

    def __enter__(self) -> None:
        self._held = self._runs._hold(threading.get_ident() if self._thread is None else self._thread)

    def __exit__(self, *exc: object) -> None:
        if self._held is not None:
            self._runs._surely(self._runs._release, self._held)


class ThreadStopDelivery:
    """The rank's: SIGINT through `MainThreadInterrupts`, asynchronous exceptions elsewhere, and the end of
    a collective by `rank/collectives.py`."""

    def __init__(self, interrupts: MainThreadInterrupts, wake: Callable[[], None]) -> None:
        self._interrupts = interrupts
        self._wake = wake  # wakes the threads waiting on actor calls (a stopped one leaves its wait)
        self.main_thread = threading.main_thread().ident or 0

    def to_main_thread(self, alive: Callable[[], bool], current: Callable[[], bool]) -> None:
        """SIGINT, sent again until the handler raised it in the run (`rank/interrupts.py`)."""
        self._interrupts.interrupt(alive, current)

    def to_thread(self, thread: int) -> None:
        """An asynchronous KeyboardInterrupt, and a wake from `time.sleep` and the actors' waits."""
        stop_thread(thread)
        self._wake()

    def withdraw(self, thread: int) -> None:
        """The stop not raised yet in `thread` is forgotten."""
        withdraw_stop(thread)

    def end_collective(self, thread: int) -> str:
        """`collectives.free_thread`: how the collective `thread` waits in was ended, or ""."""
        return collectives.free_thread(thread)
