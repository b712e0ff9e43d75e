"""One actor on a rank: its instance, the endpoints it answers, and the calls waiting for it."""

from __future__ import annotations

import contextvars
import inspect
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.actors.base import current_actor, current_point, is_concurrent, is_endpoint, takes_port
from monarch_kernel.actors.ports import Port
from monarch_kernel.core.shape import Point, Shape
from monarch_kernel.core.supervision import SUPERVISE
from monarch_kernel.rank.cell import describe_failure
from monarch_kernel.rank.deadlocks import not_here
from monarch_kernel.rank.recent import MAX_REMEMBERED
from monarch_kernel.wire.messages import ActorCall, Failure, FailureCause
from monarch_kernel.wire.serialization import unseal


@dataclass(eq=False)
class Mailbox:
    """An actor and its queue: one call runs at a time (`busy`), the rest wait in arrival order."""

    name: str
    key: str
    instance: Any
    shape: Shape
    point: Point
    queue: deque = field(default_factory=deque)
    busy: bool = False
    in_async: bool = False  # what keeps it busy is an async endpoint (on the actor's own event loop)
    stopped: bool = False  # stopped or replaced: calls that come now are told so
    endpoints: dict = field(default_factory=dict)  # name -> (bound method, is async, label, takes a port, concurrent)
    tasks: set = field(default_factory=set)  # its concurrent endpoints' running tasks (cancelled when it stops)
    failed: Failure | None = None  # its constructor raised (no instance): every call is answered with this
    slot: str = ""  # what a later spawn replaces it by: its name, qualified by who spawned it (see Mailboxes)
    own_loop: Any = None  # an async actor's own event loop (`rank/actor_loops.py`); None: a sync actor

    def endpoint(self, name: str) -> tuple[Any, bool, str, bool, bool] | None:
        """The endpoint called `name` (looked up once per name), or None."""
        found = self.endpoints.get(name)
        if found is None:
            method = getattr(self.instance, name, None)
            if method is None or not (is_endpoint(method) or name == SUPERVISE):
                return None  # only @endpoint methods answer calls (and __supervise__, asked by the controller)
            label = f"{type(self.instance).__name__}.{name}"
            if name == SUPERVISE and serves_async(type(self.instance)):
                # as in Monarch, an async actor hears of a failure while its endpoints run (one of them may
                # be waiting for exactly that): its __supervise__ runs on the loop beside them
                found = (_on_loop(method), True, label, False, True)
            else:
                found = (method, inspect.iscoroutinefunction(method), label, takes_port(method), is_concurrent(method))
            self.endpoints[name] = found
        return found


def serves_async(cls: type) -> bool:
    """Whether an actor class's endpoints are async (it then serves them on an event loop of its own)."""
    return any(inspect.iscoroutinefunction(getattr(cls, n, None)) for n in getattr(cls, "_endpoints", ()))


def _on_loop(method: Any) -> Any:
    """`method` as a coroutine function (a sync __supervise__ of an async actor runs on its loop too)."""
    if inspect.iscoroutinefunction(method):
        return method

    async def run(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return run


class Mailboxes:
    """A rank's actors by spawn key ("name#N"), which spawn of each slot is current, and the spawns
    that ended (so that a late call hears why). Guarded by the rank's actor lock, given.

    A slot is an actor mesh's name as spawned by one spawner (the notebook, or one actor): a spawn
    replaces the earlier spawn of its slot (re-running a cell), while actor meshes of one name that
    different actors spawned live side by side, as in Monarch."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.instances: dict[str, Any] = {}  # what `actors[...]` shows in %%mesh cells
        self._by_key: dict[str, Mailbox] = {}
        self._keys: dict[str, str] = {}  # slot -> key of its current spawn
        self._retired: dict[str, tuple[str, bool]] = {}  # keys of ended spawns -> (their name, replaced?)

    def get(self, key: str) -> Mailbox | None:
        """The mailbox of spawn `key`, if it is here."""
        return self._by_key.get(key)

    def add(self, box: Mailbox) -> None:
        """A new spawn (lock held)."""
        if box.instance is not None:  # (one whose constructor still runs shows once it is made)
            self.instances[box.name] = box.instance
        self._keys[box.slot or box.name] = box.key
        self._by_key[box.key] = box

    def add_system(self, box: Mailbox) -> None:
        """The rank's system actor (not an actor mesh of the user's)."""
        self._by_key[box.key] = box

    def current(self) -> list[Mailbox]:
        """The current spawn of each actor mesh here."""
        return [box for box in map(self._by_key.get, self._keys.values()) if box]

    def is_current(self, key: str) -> str | None:
        """The slot of spawn `key` if it is the current one of its slot here, else None."""
        box = self._by_key.get(key)
        slot = None if box is None else box.slot or box.name
        return slot if slot is not None and self._keys.get(slot) == key else None

    def remove(self, slot: str, replaced: bool) -> tuple[Mailbox, list[ActorCall]] | None:
        """Retire the current spawn of `slot` (lock held): its mailbox and the calls that were queued for it."""
        key = self._keys.pop(slot, None)
        box = self._by_key.pop(key, None) if key is not None else None
        if key is None or box is None:
            return None
        name = box.name
        if name in self.instances and self.instances[name] is box.instance:
            del self.instances[name]
        box.stopped = True
        queued = list(box.queue)
        box.queue.clear()
        self._retired[key] = (name, replaced)
        while len(self._retired) > MAX_REMEMBERED:
            del self._retired[next(iter(self._retired))]
        return box, queued

    def not_here(self, rank: int, key: str) -> Failure:
        """What a call to spawn `key`, not here, is told."""
        return not_here(rank, key, self._retired.get(key), self._keys)


def prepare_call(box: Mailbox, msg: ActorCall, rank: int) -> tuple[bool, Any, str, tuple, dict] | Failure:
    """(is async, method, label, args, kwargs) of a call to `box` on `rank`, or why it cannot run.

    An endpoint that takes a Port gets it first: the port the call was sent with (`send(..., port=)`),
    else one that answers the call (from this rank)."""
    found = box.endpoint(msg.endpoint)
    if found is None:
        return Failure.of(FailureCause.NO_SUCH_ENDPOINT, f"{type(box.instance).__name__} has no endpoint "
                          f"{msg.endpoint!r} (only methods marked @endpoint answer calls)")
    method, is_async, label, with_port, _ = found
    try:
        args, kwargs = unseal(msg.args)
    except Exception as exc:  # noqa: BLE001 - said to the caller
        return describe_failure(exc)
    if with_port:
        port: Port[Any] = Port(msg.caller, msg.call_id) if msg.to_port else Port(msg.caller, msg.call_id, answers=rank)
        args = (port, *args)
    return is_async, method, label, args, kwargs


def point_of(box: Mailbox, msg: ActorCall) -> Point:
    """current_rank() in an endpoint: the actor's point in the (sliced) mesh the call was sent through."""
    through = msg.through
    found = None if through is None else Shape(*through).numbered_point(box.shape.ranks[box.point.rank])
    return box.point if found is None else found


def context_at(point: Point, key: str) -> contextvars.Context:
    """A context in which current_rank() is `point` and the current actor `key` (for an async endpoint)."""
    ctx = contextvars.copy_context()
    ctx.run(current_point.set, point)
    ctx.run(current_actor.set, key)
    return ctx
