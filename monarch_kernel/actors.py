"""Actors on the mesh, in the style of PyTorch Monarch.

>>> class Trainer(Actor):
...     def __init__(self, lr):
...         self.lr = lr
...     @endpoint
...     def step(self, batch) -> float: ...
>>> trainers = mesh.spawn("trainers", Trainer, lr=1e-3)   # one Trainer per rank
>>> trainers.step.call(batch).get()      # ValueMesh of every rank's reply
>>> trainers.slice(gpus=0).step.call_one(batch).get()

Calls travel as one message per host; each actor serves its messages one at a time in
each sender's order. Actor meshes may be passed to other actors and called from
their endpoints (ranks on one host reach each other through their host agent).
"""

from __future__ import annotations

import itertools
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .actor_host import current_point
from .calls import CallSender, PendingCall, find_sender
from .errors import (
    MeshInterrupted,
    MeshNotRunningError,
    MeshTimeoutError,
    MeshUsageError,
    RankDiedError,
    RankFailure,
    RemoteError,
)
from .futures import raise_for
from .messages import ActorCall, ActorReply, CancelCall
from .serialization import release, seal, unseal
from .shape import Point, Selector, Shape, format_ranks
from .sinks import report_timing
from .values import ValueMesh

if TYPE_CHECKING:
    from .mesh import Mesh

T = TypeVar("T")
_ENDPOINT_MARK = "_monarch_endpoint"
INTERRUPT_GRACE_S = 0.5


class ActorError(RemoteError):
    """An endpoint raised on some ranks; names the actor, endpoint and ranks."""


class ActorDiedError(ActorError, RankDiedError):
    """A rank holding the actor died before it answered."""


def endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an Actor method (sync or `async def`) as callable from other processes."""
    setattr(fn, _ENDPOINT_MARK, True)
    return fn


class Actor:
    """Base class of actors: subclass it, mark methods with @endpoint, spawn on a mesh."""

    _endpoints: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = set()
        for klass in cls.__mro__:
            names.update(n for n, v in vars(klass).items() if getattr(v, _ENDPOINT_MARK, False))
        cls._endpoints = frozenset(names)


def current_rank() -> Point:
    """Inside an endpoint: this actor's coordinates in its actor mesh (with .rank).

    In a `%%mesh` cell: this rank's coordinates in the whole mesh.
    """
    point = current_point.get()
    if point is not None:
        return point
    if "RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        raise MeshUsageError("current_rank() tells where code runs on a mesh; call it in an endpoint or %%mesh cell")
    rank, per_host = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ.get("WORLD_SIZE", per_host))
    shape = Shape.grid(hosts=world // per_host, gpus=per_host)
    return next(p for p in shape.points() if p.rank == rank)


# ------------------------------------------------------------------ futures


class ActorFuture(Generic[T]):
    """The reply (or replies) of an actor call: `.get(timeout)` or `await` it."""

    def __init__(self, mesh: ActorMesh, pending: PendingCall, finish: Callable[[PendingCall], T],
                 count: int | None = None):
        self._mesh = mesh
        self._pending = pending
        self._finish = finish
        self._count = len(pending.ranks) if count is None else count

    def done(self) -> bool:
        """Whether the replies are in."""
        return len(self._pending.replies) >= self._count

    def get(self, timeout: float | None = None) -> T:
        """Wait for the replies; raises ActorError, MeshTimeoutError or MeshInterrupted.

        A timeout or Ctrl-C also tells the endpoint to stop (KeyboardInterrupt in a sync
        endpoint, cancellation of an async one), so the actor is free for the next call.
        """
        if self.done():  # already in (pipelined calls: read along with earlier replies)
            return self._finish(self._pending)
        sender = self._mesh._sender()
        if sender.must_not_wait_on(self._pending.outstanding):
            raise MeshUsageError(
                f"{self._pending.label}: this rank would wait on itself (its main thread serves its own actors). "
                "In an endpoint, make it `async def` and `await` the call; in a %%mesh cell, call the actors "
                "of other ranks (or call from the notebook)")
        try:
            finished = sender.wait_for_replies(self._pending, self._count, timeout)
        except KeyboardInterrupt:
            raise self._stop("was interrupted", MeshInterrupted) from None
        if not finished:
            raise self._stop(f"timed out after {timeout:g} s", MeshTimeoutError)
        return self._finish(self._pending)

    def result(self, timeout: float | None = None) -> T:
        """Alias of get()."""
        return self.get(timeout)

    def __await__(self):
        return self._await().__await__()

    async def _await(self) -> T:
        self._mesh._sender().flush_calls()
        try:
            await self._pending.wait_async(self._count)
        except BaseException:  # cancelled or interrupted: stop the remote work too
            self._mesh._cancel(self._pending)
            raise
        return self._finish(self._pending)

    def _stop(self, why: str, error_type: type) -> BaseException:
        self._mesh._cancel(self._pending)
        try:
            self._mesh._sender().wait_for_replies(self._pending, len(self._pending.ranks), INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pass
        failures = _failures(self._pending, self._mesh)
        return error_type(f"{self._pending.label} {why} on ranks {format_ranks(self._pending.ranks)}; "
                          "the endpoint was told to stop", failures)

    def __repr__(self) -> str:
        state = "done" if self.done() else f"waiting on ranks {format_ranks(self._pending.outstanding)}"
        return f"<ActorFuture {self._pending.label}: {state}>"


@dataclass(frozen=True)
class ActorFailureEvent:
    """What an on_failure callback receives: which actor lost which rank, and why."""

    actor: str
    rank: int
    reason: str


# ------------------------------------------------------------------ meshes of actors


class ActorMesh:
    """One actor per rank of a mesh (or slice): `actors.endpoint.call(...)` and friends."""

    _choices = itertools.count()

    def __init__(self, mesh_name: str, actor: str, class_name: str, endpoints: frozenset[str], shape: Shape,
                 key: str | None = None):
        self.mesh_name = mesh_name
        self.name = actor
        self.key = key or actor  # which spawn of `actor` this handle calls (name#N)
        self.class_name = class_name
        self.endpoints = endpoints
        self.shape = shape

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the actors in this (sliced) mesh."""
        return self.shape.ranks

    def __getattr__(self, name: str) -> EndpointHandle:
        if name.startswith("_") or name not in self.__dict__.get("endpoints", ()):
            known = ", ".join(sorted(self.__dict__.get("endpoints", ()))) or "none"
            raise AttributeError(f"{self.__dict__.get('class_name', 'actor')} has no endpoint {name!r} "
                                 f"(endpoints: {known}; mark methods with @endpoint)")
        return EndpointHandle(self, name)

    def slice(self, **selectors: Selector | None) -> ActorMesh:
        """The actors on a slice: `trainers.slice(hosts=0, gpus=slice(0, 2))`."""
        return ActorMesh(self.mesh_name, self.name, self.class_name, self.endpoints, self.shape.slice(**selectors),
                         self.key)

    def on_failure(self, callback: Callable[[ActorFailureEvent], None]) -> None:
        """Call callback(ActorFailureEvent) on a helper thread when a rank of this actor mesh dies."""
        sender = self._sender()
        watch = getattr(sender, "watch_failures", None)
        if watch is None:
            raise MeshUsageError("on_failure() is for the notebook that spawned the actors")
        watch(self.ranks, lambda rank, why: callback(ActorFailureEvent(self.name, rank, why)))

    def __reduce__(self):
        return (ActorMesh, (self.mesh_name, self.name, self.class_name, self.endpoints, self.shape, self.key))

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} of {self.class_name} on {self.shape} (ranks {format_ranks(self.ranks)})>"

    # ------------------------------------------------------------ plumbing
    def _sender(self) -> CallSender:
        sender = find_sender(self.mesh_name)
        if sender is None:
            raise MeshNotRunningError(f"actor mesh {self.name!r}: mesh {self.mesh_name!r} is not reachable from here")
        return sender

    def _send(self, endpoint_name: str, ranks: tuple[int, ...], args: tuple, kwargs: dict,
              want_value: bool = True, on_reply: Callable[[ActorReply], None] | None = None) -> PendingCall:
        sender = self._sender()
        sealed = seal((args, kwargs), shm_dir=sender.shm_dir_for(ranks), shared=True)
        label = f"{self.class_name}.{endpoint_name}"

        pending = sender.calls.new(ranks, label, on_reply)
        if sealed.shm_paths():  # shared-memory arguments: remove them once every rank answered

            def replied(reply: ActorReply) -> None:
                if on_reply is not None:
                    on_reply(reply)
                if pending.done():
                    release(sealed)

            pending.on_reply = replied
        sender.send_call(ActorCall(sender.caller_id, pending.call_id, self.key, endpoint_name, sealed,
                                   ranks, want_value))
        return pending

    def _cancel(self, pending: PendingCall) -> None:
        outstanding = pending.outstanding
        if outstanding:
            sender = self._sender()
            sender.send_cancel(CancelCall(sender.caller_id, pending.call_id, outstanding))

    def _host_of(self, rank: int) -> str:
        host_of = getattr(self._sender(), "host_of", None)
        return host_of(rank) if host_of is not None else ""


class EndpointHandle:
    """`actors.step`: the ways to call one endpoint on an actor mesh."""

    def __init__(self, mesh: ActorMesh, name: str):
        self._mesh = mesh
        self._name = name

    def call(self, *args: Any, **kwargs: Any) -> ActorFuture[ValueMesh]:
        """Call on every actor; the future gives a ValueMesh of their replies."""
        mesh = self._mesh
        pending = mesh._send(self._name, mesh.ranks, args, kwargs)
        return ActorFuture(mesh, pending, lambda p: _value_mesh(p, mesh, timed=True))

    def call_one(self, *args: Any, **kwargs: Any) -> ActorFuture[Any]:
        """Call the one actor of a one-rank slice; the future gives its reply."""
        mesh = self._mesh
        if len(mesh.ranks) != 1:
            raise MeshUsageError(f"call_one() needs a one-actor slice, but {mesh.name!r} here spans "
                                 f"{len(mesh.ranks)} ranks; slice it first (e.g. .slice(gpus=0)) or use call()")
        pending = mesh._send(self._name, mesh.ranks, args, kwargs)
        return ActorFuture(mesh, pending, lambda p: _single(p, mesh))

    def choose(self, *args: Any, **kwargs: Any) -> ActorFuture[Any]:
        """Call any one actor (round robin over the live ones); the future gives its reply."""
        mesh = self._mesh
        sender = mesh._sender()
        alive = getattr(sender, "is_alive", lambda rank: True)
        candidates = [r for r in mesh.ranks if alive(r)] or list(mesh.ranks)
        rank = candidates[next(ActorMesh._choices) % len(candidates)]
        pending = mesh._send(self._name, (rank,), args, kwargs)
        return ActorFuture(mesh, pending, lambda p: _single(p, mesh))

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Call every actor without waiting; failures are printed when they come back."""
        mesh = self._mesh
        label = f"{mesh.class_name}.{self._name}"

        def report(reply: ActorReply) -> None:
            if reply.failure is not None:
                print(f"monarch_kernel: broadcast {label} failed on rank {reply.rank}: "
                      f"{reply.failure.message}\n{reply.failure.traceback}", file=sys.stderr, flush=True)

        mesh._send(self._name, mesh.ranks, args, kwargs, want_value=False, on_reply=report)

    def stream(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Iterator[ReplyFuture]:
        """Call every actor; yield each reply (a done future with .rank) as it arrives."""
        mesh = self._mesh
        pending = mesh._send(self._name, mesh.ranks, args, kwargs)
        waiter = ActorFuture(mesh, pending, lambda p: None)
        sender = mesh._sender()
        for count in range(1, len(pending.ranks) + 1):
            try:
                arrived = sender.wait_for_replies(pending, count, timeout)
            except KeyboardInterrupt:
                raise waiter._stop("was interrupted", MeshInterrupted) from None
            if not arrived:
                raise waiter._stop(f"timed out after {timeout:g} s", MeshTimeoutError)
            rank = pending.arrivals[count - 1]
            yield ReplyFuture(mesh, pending, rank)

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh.class_name}.{self._name} on ranks {format_ranks(self._mesh.ranks)}>"


class ReplyFuture:
    """One rank's reply from `stream()`: already done; `.get()` returns it or raises."""

    def __init__(self, mesh: ActorMesh, pending: PendingCall, rank: int):
        self._mesh, self._pending, self.rank = mesh, pending, rank
        self.point = next(p for p in mesh.shape.points() if p.rank == rank)

    def done(self) -> bool:
        """Always True."""
        return True

    def get(self, timeout: float | None = None) -> Any:
        """The reply's value (or its error)."""
        return _single(self._pending, self._mesh, self.rank)

    def __await__(self):
        async def now():
            return self.get()
        return now().__await__()

    def __repr__(self) -> str:
        return f"<reply of {self._pending.label} from rank {self.rank}>"


# ------------------------------------------------------------------ results


def _failures(pending: PendingCall, mesh: ActorMesh, ranks: tuple[int, ...] | None = None) -> list[RankFailure]:
    found = []
    for rank in ranks if ranks is not None else pending.ranks:
        reply = pending.replies.get(rank)
        if reply is None or reply.failure is None:
            continue
        f = reply.failure
        kind = ("died" if f.error_type == "RankDied" else "lost" if f.error_type == "MeshRestarted"
                else "interrupted" if f.interrupted else "exception")
        message = f"{pending.label} (actor mesh {mesh.name!r}) on rank {rank}: {f.message}"
        found.append(RankFailure(rank, mesh._host_of(rank), kind, f.error_type, message, f.traceback))
    return found


def _raise_failures(pending: PendingCall, mesh: ActorMesh, ranks: tuple[int, ...], partial: object) -> None:
    failures = _failures(pending, mesh, ranks)
    if not failures:
        return
    kinds = sorted({f.error_type for f in failures})
    summary = (f"{pending.label} (actor mesh {mesh.name!r}) failed on rank"
               f"{'s' if len(failures) > 1 else ''} {format_ranks([f.rank for f in failures])}: {', '.join(kinds)}")
    raise_for(failures, summary, partial, ActorError, ActorDiedError)


def _value(reply: ActorReply) -> Any:
    return None if reply.value is None else unseal(reply.value)


def _value_mesh(pending: PendingCall, mesh: ActorMesh, timed: bool = False) -> ValueMesh:
    if timed:
        times = [(r, pending.replies[r].seconds, pending.replies[r].failure is None) for r in mesh.ranks]
        record = getattr(mesh._sender(), "record_timing", None)
        if record is not None:
            record(pending.label, times)
            report_timing(f"{pending.label} (actor mesh {mesh.name!r})", times)
    values = [_value(pending.replies[r]) if pending.replies[r].failure is None else None for r in mesh.ranks]
    vm = ValueMesh(mesh.shape, values)
    _raise_failures(pending, mesh, mesh.ranks, vm)
    return vm


def _single(pending: PendingCall, mesh: ActorMesh, rank: int | None = None) -> Any:
    rank = pending.ranks[0] if rank is None else rank
    _raise_failures(pending, mesh, (rank,), None)
    return _value(pending.replies[rank])


# ------------------------------------------------------------------ spawning


_spawns = itertools.count(1)


def spawn(mesh: Mesh, name: str, cls: type, args: tuple, kwargs: dict) -> ActorMesh:
    """Create one `cls(*args, **kwargs)` per rank of `mesh`; see Mesh.spawn.

    Spawning a name again replaces that actor mesh on these ranks (re-running a cell).
    """
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise MeshUsageError(f"spawn() needs a subclass of monarch_kernel.Actor, got {cls!r}")
    if not name or not isinstance(name, str):
        raise MeshUsageError("spawn() needs a name for the actor mesh, e.g. mesh.spawn('trainers', Trainer)")
    shape = mesh.shape
    spawned = mesh._runtime.actor_meshes
    sources = notebook_sources(cls)
    key = f"{name}#{next(_spawns)}"

    def create(worker: Any) -> str:
        return worker.actors.spawn(name, key, cls, args, kwargs, shape, sources)

    mesh._call_in_worker(create, f"spawn({name!r}, {cls.__name__})")
    spawned[name] = tuple(sorted(set(spawned.get(name, ())) | set(shape.ranks)))
    return ActorMesh(mesh.name, name, cls.__name__, cls._endpoints, shape, key)


def notebook_sources(cls: type) -> dict[str, list[str]]:
    """Source lines of the cells that define cls (and its bases), for remote tracebacks."""
    sources: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        for value in vars(klass).values():
            fn = getattr(value, "__func__", value)
            code = getattr(fn, "__code__", None)
            if code is None or code.co_filename in sources or os.path.exists(code.co_filename):
                continue
            lines = linecache.getlines(code.co_filename)
            if lines:
                sources[code.co_filename] = lines
    return sources

