"""Handles on actor meshes, in the style of PyTorch Monarch: calls, futures, replies.

>>> trainers = mesh.spawn("trainers", Trainer, lr=1e-3)   # one Trainer per rank
>>> trainers.step.call(batch).get()      # ValueMesh of every rank's reply
>>> trainers.slice(gpus=0).step.call_one(batch).get()

Handles work wherever they are used (the notebook; ranks, of this mesh or another), sending through the
`CallSender` of their process: one message per host, served in each sender's order.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from monarch_kernel.actors.base import SYSTEM_ACTOR, Parameters, check_arguments, current_actor, owner_label
from monarch_kernel.actors.ports import Port
from monarch_kernel.core.errors import (
    ActorError,
    MeshNotRunningError,
    MeshTimeoutError,
    MeshUsageError,
    SupervisionError,
    raise_for,
)
from monarch_kernel.core.failures import FailureKind, RankFailure
from monarch_kernel.core.future import DoneFuture, FailedFuture, Future
from monarch_kernel.core.identity import ActorOrigin
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.shape import MeshShaped, Point, Shape
from monarch_kernel.core.supervision import MeshFailure, Owner, report_unhandled
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.wire.calls import CallSender, PendingCall, find_sender
from monarch_kernel.wire.messages import ActorCall, ActorReply, BroadcastFailed, CancelCall, FailureCause, Through
from monarch_kernel.wire.ops import StopActors
from monarch_kernel.wire.serialization import release, seal, unseal

T = TypeVar("T")

_KIND_OF_ERROR = {FailureCause.RANK_DIED: FailureKind.DIED, FailureCause.MESH_RESTARTED: FailureKind.LOST}  # (a router's)
# calls to actors that no longer are (or failed in their constructor)
_GONE = frozenset({FailureCause.ACTOR_STOPPED, FailureCause.MESH_NOT_RUNNING, FailureCause.ACTOR_FAILED})


class ActorFuture(Future[T]):
    """The reply (or replies) of an actor call: `.get(timeout)` or `await` it. A timeout or Ctrl-C also
    stops the endpoint (KeyboardInterrupt in a sync one, even in a collective; an async one is cancelled)."""

    def __init__(self, mesh: ActorMesh, pending: PendingCall, finish: Callable[[PendingCall], T],
                 count: int | None = None):
        super().__init__()
        self._mesh = mesh
        self._pending = pending
        self._make_result = finish
        self._count = len(pending.ranks) if count is None else count

    def done(self) -> bool:
        """Whether the replies are in."""
        return len(self._pending.replies) >= self._count

    def get(self, timeout: float | None = None) -> T:
        """Wait for the replies; raises ActorError, MeshTimeoutError or MeshInterrupted."""
        if self._outcome is None and self.done():  # pipelined calls: read along with earlier replies
            return self._make_result(self._pending)
        return super().get(timeout)

    def _wait(self, timeout: float | None) -> bool:
        if self.done():
            return True
        return self._mesh._sender().wait_for_replies(self._pending, self._count, timeout)

    async def _wait_async(self) -> None:
        self._mesh._sender().flush_calls()
        await self._pending.wait_async(self._count)

    def _cancel(self) -> None:
        self._mesh._cancel(self._pending)
        self._count = len(self._pending.ranks)  # the grace period waits for every rank's word

    def _finish(self) -> T:
        return self._make_result(self._pending)

    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        aborted = {rank: reply.aborted for rank, reply in self._pending.replies.items() if reply.aborted}
        regrouped = self._mesh._sender().regroup(aborted) if aborted else None  # (endpoints were in collectives)
        if regrouped:
            print(f"monarch_kernel: {regrouped}", file=sys.stderr, flush=True)
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


class ActorMesh(MeshShaped):
    """One actor per rank of a mesh (or slice): `actors.endpoint.call(...)` and friends."""

    _choices = itertools.count()

    def __init__(self, mesh_name: str, actor: str, class_name: str, endpoints: frozenset[str], shape: Shape,
                 key: str | None = None, parameters: dict[str, Parameters] | None = None,
                 origin: ActorOrigin | None = None):
        clash = endpoints & _handle_names()
        if clash:
            raise MeshUsageError(f"{class_name} has endpoints named {sorted(clash)}, which actor mesh handles use "
                                 "for themselves (slice, stop, ...); rename those endpoints")
        self.mesh_name = mesh_name
        self.name = actor
        self.key = key or actor  # which spawn of `actor` this handle calls (name#N)
        self.class_name = class_name
        self.endpoints = endpoints
        self.shape = shape
        self._parameters = parameters or {}  # what each endpoint takes: calls are checked before they are sent
        self._through: Through | None = None  # a slice's (dims, ranks), which its calls carry (see _with)
        self._origin = origin  # who spawned it, its module-qualified class and spawn shape (Monarch's actor names)
        self._refused: str | None = None  # why the processes took none of these actors (see `refused`)

    def __class_getitem__(cls, actor_class: Any) -> Any:
        """`ActorMesh[Trainer]` in annotations, as Monarch's programs write them."""
        return types.GenericAlias(cls, actor_class)

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

    def _with(self, shape: Shape) -> ActorMesh:
        sliced = ActorMesh(self.mesh_name, self.name, self.class_name, self.endpoints, shape, self.key,
                           self._parameters, self.__dict__.get("_origin"))
        sliced._through = (shape.dims, shape.ranks)  # current_rank() counts in the slice, as in Monarch
        sliced._supervised = self.__dict__.get("_supervised", Owner.NOBODY)
        sliced._refused = self.__dict__.get("_refused")
        return sliced

    def stop(self, reason: str = "stopped by client", *, timeout: float | None = None) -> Future[None]:
        """Stop these actors (their queued calls fail; later calls say they were stopped), and what they own;
        `timeout`: how long to wait for that (None: as long as it takes; Ctrl-C stops waiting)."""
        system_actors(self.mesh_name, self.shape).operate.call(StopActors(self.key)).get(timeout)
        return DoneFuture(None)

    @property
    def initialized(self) -> Future[None]:
        """Done once the processes have these actors (spawn() returns then; async constructors may still run):
        raises RuntimeError if they refused them (see `refused`)."""
        refused = self.__dict__.get("_refused")
        return DoneFuture(None) if refused is None else FailedFuture(RuntimeError(refused))

    def refused(self, why: str) -> None:
        """The processes took none of these actors (Monarch's spawn on a process where an actor failed): from now
        on `initialized` and every call raise RuntimeError(why), as Monarch's do."""
        self._refused = why

    def supervise_from_notebook(self) -> None:
        """The notebook owns these actors: a rank's death, an actor's failure, or a failed broadcast, goes to its
        fault hook (while no later spawn of the same name replaced them)."""
        self._supervised = Owner.NOTEBOOK
        newest = _notebook_owned
        for rank in self.ranks:
            newest[(self.mesh_name, self.name, rank)] = self.key

        def died(rank: int, why: str) -> None:
            if newest.get((self.mesh_name, self.name, rank)) == self.key:
                report_unhandled(MeshFailure(self.name, self.class_name, rank, FailureKind.DIED, why,
                                             actor=actor_name_of(self, rank)))

        def failed(failure: MeshFailure) -> None:
            if failure.rank is None or newest.get((self.mesh_name, self.name, failure.rank)) == self.key:
                report_unhandled(failure)

        sender = self._sender()
        sender.watch_failures(self.ranks, died)
        sender.watch_actor_failures(self.key, failed)

    def on_failure(self, callback: Callable[[ActorFailureEvent], None]) -> None:
        """Call callback(ActorFailureEvent) on a helper thread when a rank of this actor mesh dies."""
        self._sender().watch_failures(self.ranks, lambda rank, why: callback(ActorFailureEvent(self.name, rank, why)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorMesh, (self.mesh_name, self.name, self.class_name, self.endpoints, self.shape, self.key,
                            self._parameters), {"_through": self._through, "_origin": self.__dict__.get("_origin")})

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} of {self.class_name} on {self.shape} (ranks {format_ranks(self.ranks)})>"

    # ------------------------------------------------------------ plumbing
    def _sender(self) -> CallSender:
        sender = find_sender(self.mesh_name)
        if sender is None:
            if self.mesh_name in STOPPED_PROC_MESHES:  # (Monarch's words for it)
                raise MeshNotRunningError(f"actor mesh {self.name!r}: the actor mesh is stopped due to proc mesh "
                                          f"shutdown (mesh {self.mesh_name!r} was stopped); spawn the actors on "
                                          "running processes")
            raise MeshNotRunningError(f"actor mesh {self.name!r}: mesh {self.mesh_name!r} is shut down or not "
                                      "reachable from here; spawn the actors on a running mesh")
        return sender

    def _send(self, endpoint_name: str, ranks: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
              want_value: bool = True, on_reply: Callable[[ActorReply], None] | None = None) -> PendingCall:
        if (refused := self.__dict__.get("_refused")) is not None:
            raise RuntimeError(refused)
        self._check(endpoint_name, args, kwargs)
        try:
            sender = self._sender()
        except MeshNotRunningError as exc:  # its processes are gone: Monarch's word for it
            raise SupervisionError(str(exc), []) from None
        away = self._away(sender)
        sealed = seal((args, kwargs), shm_dir=None if away else sender.shm_dir_for(ranks), shared=True)
        label = f"{self.class_name}.{endpoint_name}"

        pending = sender.calls.new(ranks, label, on_reply)
        pending.actor = "" if away else self.key  # (a rank's numbers in another mesh are not its own actors)
        if sealed.shm_paths():  # shared-memory arguments: remove them once every rank answered

            def replied(reply: ActorReply) -> None:
                if on_reply is not None:
                    on_reply(reply)
                if pending.done():
                    release(sealed)

            pending.on_reply = replied
        try:
            sender.send_call(ActorCall(sender.caller_id, pending.call_id, self.key, endpoint_name, sealed,
                                       ranks, want_value, mesh=away, through=self._through))
        except BaseException as exc:  # stopped mid-send: the ranks that already have the call must drop it
            sender.send_cancel(CancelCall(sender.caller_id, pending.call_id, ranks, away))
            if isinstance(exc, MeshNotRunningError):
                raise SupervisionError(str(exc), []) from None
            raise
        return pending

    def _check(self, endpoint_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if (params := self._parameters.get(endpoint_name)) is not None:
            check_arguments(f"{self.class_name}.{endpoint_name}", params, args, kwargs)

    def _away(self, sender: CallSender) -> str:
        """This mesh's name when the sender is another mesh's (a rank calling another mesh's actors), else ""."""
        return self.mesh_name if sender.other_mesh(self.mesh_name) else ""

    def _cancel(self, pending: PendingCall) -> None:
        outstanding = pending.outstanding
        if outstanding:
            sender = self._sender()
            sender.send_cancel(CancelCall(sender.caller_id, pending.call_id, outstanding, self._away(sender)))


def system_actors(mesh_name: str, shape: Shape) -> ActorMesh:
    """The system actor of each rank of `shape` (it takes SpawnActors and StopActors): see rank/ops.py."""
    return ActorMesh(mesh_name, SYSTEM_ACTOR, "processes", frozenset({"operate"}), shape, SYSTEM_ACTOR)


# (mesh, actor mesh name, rank) -> the key of the newest spawn there that the notebook owns
_notebook_owned: dict[tuple[str, str, int], str] = {}
STOPPED_PROC_MESHES: set[str] = set()  # meshes that ProcMesh.stop() ended here (their handles say so)


@functools.cache
def _handle_names() -> frozenset[str]:
    return frozenset(n for n in dir(ActorMesh) if not n.startswith("_"))


class EndpointHandle:
    """`actors.step`: the ways to call one endpoint on an actor mesh."""

    def __init__(self, mesh: ActorMesh, name: str):
        self._mesh = mesh
        self._name = name

    def call(self, *args: Any, **kwargs: Any) -> ActorFuture[ValueMesh[Any]]:
        """Call on every actor; the future gives a ValueMesh of their replies."""
        mesh = self._mesh
        pending = mesh._send(self._name, mesh.ranks, args, kwargs)
        return ActorFuture(mesh, pending, lambda p: _value_mesh(p, mesh))

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
        candidates = [r for r in mesh.ranks if sender.is_alive(r)] or list(mesh.ranks)
        rank = candidates[next(ActorMesh._choices) % len(candidates)]
        pending = mesh._send(self._name, (rank,), args, kwargs)
        return ActorFuture(mesh, pending, lambda p: _single(p, mesh))

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Call every actor without waiting; failures are printed when they come back."""
        mesh = self._mesh
        label = f"{mesh.class_name}.{self._name}"
        supervised: Owner = mesh.__dict__.get("_supervised", Owner.NOBODY)  # who owns these actors
        sender, sending_actor = mesh._sender(), current_actor.get()  # (an actor's broadcast: it is told of failures)

        def report(reply: ActorReply) -> None:
            f = reply.failure
            if f is None:
                return
            if (supervised and f.cause in _KIND_OF_ERROR) or f.cause is FailureCause.ACTOR_FAILED:
                return  # a death, or an actor that failed, reaches the owner as such; a mesh shut down is nobody's
            failure = MeshFailure(mesh.name, mesh.class_name, reply.rank, FailureKind.EXCEPTION,
                                  f"broadcast {label} raised {f.message}", f.traceback, actor=actor_name_of(mesh, reply.rank))
            if sending_actor is not None and sender.own_rank is not None:  # Monarch: the sender's __supervise__
                sender.send_up(BroadcastFailed(sender.own_rank, sending_actor,
                                               owner_label(sending_actor, sender.own_rank), failure))
            elif supervised is Owner.NOTEBOOK:
                report_unhandled(failure)
            else:
                print(f"monarch_kernel: broadcast {label} failed on rank {reply.rank}: "
                      f"{f.message}\n{f.traceback}", file=sys.stderr, flush=True)

        mesh._send(self._name, mesh.ranks, args, kwargs, want_value=False, on_reply=report)

    def send_to_port(self, port: Port[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                     selection: str = "all") -> None:
        """Call without waiting; every actor's answer goes through `port` (Monarch's `send`)."""
        mesh = self._mesh
        if selection not in ("all", "choose"):
            raise MeshUsageError(f"selection={selection!r}: use 'all' or 'choose'")
        ranks = mesh.ranks
        if selection == "choose":
            sender = mesh._sender()
            live = [r for r in ranks if sender.is_alive(r)] or list(ranks)
            ranks = (live[next(ActorMesh._choices) % len(live)],)
        mesh._check(self._name, args, kwargs)
        sender = mesh._sender()
        away = mesh._away(sender)
        sealed = seal((args, kwargs), shm_dir=None if away else sender.shm_dir_for(ranks), shared=True)
        sender.send_call(ActorCall(port._owner, port._port_id, mesh.key, self._name, sealed, ranks, True,
                                   to_port=True, mesh=away, through=mesh._through))

    def stream(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Iterator[ReplyFuture]:
        """Call every actor; one future per reply, in arrival order: the k-th is the k-th reply to arrive
        (`.rank` and `.point` say whose). `.get()` or await each; nothing waits before that, so an async
        endpoint can `[await f for f in mesh.ep.stream()]` without holding its event loop."""
        mesh = self._mesh
        pending = mesh._send(self._name, mesh.ranks, args, kwargs)
        return iter([ReplyFuture(mesh, pending, nth, timeout) for nth in range(1, len(pending.ranks) + 1)])

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh.class_name}.{self._name} on ranks {format_ranks(self._mesh.ranks)}>"


class ReplyFuture(ActorFuture[Any]):
    """The `nth` reply of a `stream()` to arrive: `.get()` (the default timeout is the stream's) or await it;
    `.rank` and `.point` name whose reply it is (they wait for it to arrive)."""

    def __init__(self, mesh: ActorMesh, pending: PendingCall, nth: int, timeout: float | None = None):
        super().__init__(mesh, pending, self._nth_value, nth)
        self._nth = nth
        self._default_timeout = timeout

    def _nth_value(self, pending: PendingCall) -> Any:
        return _single(pending, self._mesh, pending.arrivals[self._nth - 1])

    @property
    def rank(self) -> int:
        """The rank whose reply this is."""
        if len(self._pending.arrivals) < self._nth and not self._wait(self._default_timeout):
            raise MeshTimeoutError(f"reply {self._nth} of {self._pending.label} did not arrive within "
                                   f"{self._default_timeout:g} s")
        return self._pending.arrivals[self._nth - 1]

    @property
    def point(self) -> Point:
        """Where that rank sits in the actor mesh."""
        rank = self.rank
        return next(p for p in self._mesh.shape.points() if p.rank == rank)

    def __repr__(self) -> str:
        if len(self._pending.arrivals) < self._nth:
            return f"<reply {self._nth} of {self._pending.label}: not in yet>"
        return f"<reply of {self._pending.label} from rank {self.rank}>"


# ------------------------------------------------------------------ results


def actor_name_of(mesh: ActorMesh, rank: int) -> str:
    """Monarch's qualified name of the actor of `mesh` on global `rank` ("" when not known here)."""
    origin: ActorOrigin | None = mesh.__dict__.get("_origin")
    return "" if origin is None else origin.actor_name(mesh.name, rank)


def _failures(pending: PendingCall, mesh: ActorMesh, ranks: tuple[int, ...] | None = None) -> list[RankFailure]:
    found = []
    for rank in ranks if ranks is not None else pending.ranks:
        reply = pending.replies.get(rank)
        if reply is None or reply.failure is None:
            continue
        f = reply.failure
        sender = mesh._sender()
        kind = _KIND_OF_ERROR.get(f.cause, FailureKind.INTERRUPTED if f.interrupted else FailureKind.EXCEPTION)
        message = f"{pending.label} (actor mesh {mesh.name!r}) on rank {rank}: {f.message}"
        found.append(RankFailure(rank, sender.host_of(rank), kind, f.error_type, message, f.traceback))
    return found


def raise_failures(pending: PendingCall, mesh: ActorMesh, ranks: tuple[int, ...], partial: object) -> None:
    """Raise the failures of `ranks` in a finished call, if any (ActorError naming them; `partial`: the answers)."""
    failures = _failures(pending, mesh, ranks)
    if not failures:
        return
    kinds = sorted({f.error_type for f in failures})
    endpoint = pending.label.rsplit(".", 1)[-1]  # (Monarch's words first: "Actor call name.endpoint failed")
    summary = (f"Actor call {mesh.name}.{endpoint} failed on rank{'s' if len(failures) > 1 else ''} "
               f"{format_ranks([f.rank for f in failures])} ({pending.label}): {', '.join(kinds)}")
    gone = any(reply.failure is not None and reply.failure.cause in _GONE
               for rank in ranks if (reply := pending.replies.get(rank)) is not None)
    if gone:  # its actors are gone, rather than it failed
        raise SupervisionError(_supervision_summary(pending, mesh, failures, summary), failures, partial)
    if any(f.kind == FailureKind.DIED for f in failures):
        summary = _supervision_summary(pending, mesh, failures, summary)
    raise_for(failures, summary, partial, ActorError, SupervisionError)


def _supervision_summary(pending: PendingCall, mesh: ActorMesh, failures: list[RankFailure], summary: str) -> str:
    """Monarch's words for a call whose actors are gone: "Endpoint call name.endpoint() failed, The actor
    <...> and all its descendants have failed: ..." (ours goes on with which ranks and why)."""
    first = failures[0].rank
    actor = actor_name_of(mesh, first) or f"<{mesh.class_name} {mesh.name}> on rank {first}"
    endpoint = pending.label.rsplit(".", 1)[-1]
    return f"Endpoint call {mesh.name}.{endpoint}() failed, The actor {actor} and all its descendants have failed: {summary}"


def reply_value(reply: ActorReply) -> Any:
    """The value an actor's reply carries."""
    return None if reply.value is None else unseal(reply.value)


def _value_mesh(pending: PendingCall, mesh: ActorMesh) -> ValueMesh[Any]:
    times = [RankTiming(r, pending.replies[r].seconds, pending.replies[r].failure is None) for r in mesh.ranks]
    mesh._sender().record_timing(pending.label, f"{pending.label} (actor mesh {mesh.name!r})", times)
    values = [reply_value(pending.replies[r]) if pending.replies[r].failure is None else None for r in mesh.ranks]
    vm = ValueMesh(mesh.shape, values)
    raise_failures(pending, mesh, mesh.ranks, vm)
    return vm


def _single(pending: PendingCall, mesh: ActorMesh, rank: int | None = None) -> Any:
    rank = pending.ranks[0] if rank is None else rank
    raise_failures(pending, mesh, (rank,), None)
    return reply_value(pending.replies[rank])
