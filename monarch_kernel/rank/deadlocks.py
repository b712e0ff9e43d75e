"""Actor calls a rank cannot serve, named instead of hanging: waits that could never end
(`ActorDeadlockError`), and calls to an actor that is not there (stopped, replaced, never spawned).

Each sync call runs on a thread of its own while it runs (`rank/user_threads.py`), so an endpoint
may block on another actor of its own rank; an async actor has an event loop of its own
(`rank/actor_loops.py`), so an async endpoint may block on another actor too. What can never finish:
an actor waiting on itself (it serves one call at a time), actors whose calls wait on each other in a
cycle, and a blocking wait on an actor's event loop (an async endpoint calling `.get()`) for an async
endpoint that this loop would have to run.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from monarch_kernel.core.errors import ActorDeadlockError
from monarch_kernel.rank.runs import Runs
from monarch_kernel.wire.messages import Failure, FailureCause


def not_here(rank: int, key: str, retired: tuple[str, bool] | None, keys: dict[str, str]) -> Failure:
    """What a call to actor mesh spawn `key` is told on `rank` where it is not: `retired` is (its name,
    whether it was replaced) for one that ended here, `keys` the actor meshes here by name."""
    name, replaced = retired or ("", False)
    if name and not replaced:
        return Failure.of(FailureCause.ACTOR_STOPPED, f"actor mesh {name!r} was stopped on rank {rank}")
    if name:
        return Failure.of(FailureCause.ACTOR_REPLACED, f"actor mesh {name!r} was spawned again on rank {rank}; this "
                          "handle still points at the old actors: use the one the new spawn() returned")
    known = ", ".join(sorted({slot.rsplit("\n", 1)[-1] for slot in keys})) or "none"
    return Failure("ActorNotFound", f"no actor mesh {key.split('#')[0]!r} on rank {rank} (actor meshes here: "
                   f"{known}); it was never spawned here, or the mesh restarted", "")


class WaitGraph:
    """Which actor of this rank each thread waits on; with the sync calls each thread runs (`Runs`: nested
    when a thread serves a call inside its own wait), whether a wait could never end."""

    def __init__(self, runs: Runs) -> None:
        self._runs = runs
        self._waiting: dict[int, Any] = {}  # thread -> the mailbox it waits on

    def runs_here(self, box: Any) -> bool:
        """Whether the calling thread runs a call of `box` (at any depth)."""
        return any(run.actor is box for run in self._runs.calls_by_thread().get(threading.get_ident(), ()))

    def waits_on(self, box: Any | None) -> Any | None:
        """The calling thread waits on a call to `box` (None: on nothing of this rank); returns what it
        waited on before."""
        me = threading.get_ident()
        before = self._waiting.pop(me, None)
        if box is not None:
            self._waiting[me] = box
        return before

    def check(self, rank: int, box: Any, waited_label: str, loop_thread: int) -> None:
        """Raise ActorDeadlockError if the calling thread's wait on `box` (busy) could never end; `loop_thread`
        runs the event loop that `box`'s async endpoints need."""
        me = threading.get_ident()
        on_loop = me == loop_thread
        running = self._runs.calls_by_thread()
        mine = running.get(me, [])
        waiter = mine[-1].label if mine else ("an async endpoint" if _on_an_event_loop() else "this %%mesh cell")
        labels = [waiter]
        target = box
        for _ in range(len(running) + 1):
            found = next(((t, stack) for t, stack in running.items() if any(run.actor is target for run in stack)), None)
            if found is None:  # async, or a sync call about to start: only a wait on the loop keeps an
                if on_loop and target is box and getattr(target, "in_async", False):  # async one from running
                    raise ActorDeadlockError(
                        f"{waiter} on rank {rank} blocks its actor's event loop waiting on {waited_label}, an "
                        "async endpoint of the same actor, which that loop would run. Use `await` on the call "
                        f"instead of .get(), or make {waited_label} a plain def.")
                return
            thread, stack = found
            if thread == me:
                depth = next(i for i, run in enumerate(stack) if run.actor is target)
                if len(labels) == 1 and depth == len(stack) - 1:
                    raise ActorDeadlockError(
                        f"{waiter} on rank {rank} waits on {waited_label} of its own actor, which serves "
                        f"one message at a time and is busy in {waiter}: an actor cannot wait on itself. Call "
                        "the method directly (self.method(...)), or make the endpoint async def and await the call.")
                cycle = " -> ".join(labels + [run.label for run in stack[depth:]])
                raise ActorDeadlockError(
                    f"deadlock on rank {rank}: {waiter} waits on {waited_label}, whose actor is busy in a call "
                    f"that waits in turn on {waiter} ({cycle}); actors that wait on each other in a cycle never "
                    "finish. Break the cycle: do not call back, or make one of the endpoints async def and await the call.")
            labels.append(stack[-1].label)
            target = self._waiting.get(thread)
            if target is None:
                return


def _on_an_event_loop() -> bool:
    """Whether the calling code runs inside an event loop (an async endpoint that blocks on a call)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
