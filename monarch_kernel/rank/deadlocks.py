"""Actor calls a rank cannot serve, named instead of hanging: waits that could never end
(`ActorDeadlockError`), and calls to an actor that is not there (stopped, replaced, never spawned).

A rank's main thread serves its actors' mailboxes from inside a sync endpoint's (or a cell's)
wait. What it cannot serve from there: the actor that is waiting (an actor waiting on
itself), an actor busy further out on the same stack (a cycle), and an async endpoint (the
event loop that would run it is the thread that waits).
"""

from __future__ import annotations

from typing import Any

from monarch_kernel.core.errors import ActorDeadlockError
from monarch_kernel.wire.messages import Failure


def not_here(rank: int, key: str, retired: tuple[str, bool] | None, keys: dict[str, str]) -> Failure:
    """What a call to actor mesh spawn `key` is told on `rank` where it is not: `retired` is (its name,
    whether it was replaced) for one that ended here, `keys` the actor meshes here by name."""
    name, replaced = retired or ("", False)
    if name and not replaced:
        return Failure("ActorStopped", f"actor mesh {name!r} was stopped on rank {rank}", "")
    if name:
        return Failure("ActorReplaced", f"actor mesh {name!r} was spawned again on rank {rank}; this handle "
                       "still points at the old actors: use the one the new spawn() returned", "")
    known = ", ".join(sorted(keys)) or "none"
    return Failure("ActorNotFound", f"no actor mesh {key.split('#')[0]!r} on rank {rank} (actor meshes here: "
                   f"{known}); it was never spawned here, or the mesh restarted", "")


def raise_deadlock(rank: int, waited_label: str, serving: list[tuple[Any, str]], box: Any) -> None:
    """Raise ActorDeadlockError for a wait on `waited_label`, whose actor (`box`) is busy.

    `serving`: the (mailbox, endpoint label) of the sync calls running on this rank, outermost first.
    """
    waiter = serving[-1][1] if serving else "this %%mesh cell"
    target = type(box.instance).__name__
    for i, (running, label) in enumerate(serving):
        if running is box:
            if i == len(serving) - 1:
                raise ActorDeadlockError(
                    f"{waiter} on rank {rank} waits on {waited_label} of its own actor, which serves "
                    f"one message at a time and is busy in {waiter}: an actor cannot wait on itself. Call the "
                    "method directly (self.method(...)), or make the endpoint async def and await the call.")
            cycle = " -> ".join([lbl for _, lbl in serving[i:]] + [waited_label])
            raise ActorDeadlockError(
                f"deadlock on rank {rank}: {waiter} waits on {waited_label}, but {target} is busy in "
                f"{label}, which waits on {waiter.split('.')[0]} in turn ({cycle}); actors that wait on each "
                "other in a cycle never finish. Break the cycle: do not call back, or make one of the "
                "endpoints async def and await the call.")
    raise ActorDeadlockError(
        f"{waiter} on rank {rank} waits on {waited_label}, an async endpoint of this rank; it runs "
        "on the rank's event loop, which is the thread that waits. Make the waiting endpoint async def "
        f"and await the call, or make {waited_label} a plain def.")
