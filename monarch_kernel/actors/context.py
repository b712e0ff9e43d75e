"""`context()`: which actor runs this code, and where the current message was sent, as in Monarch.

>>> class Named(Actor):
...     @endpoint
...     def who(self) -> str:
...         return str(context().actor_instance)     # "<root>.<cells.Named workers{'gpus': 1/2}>"

In an endpoint or constructor it describes that actor; elsewhere (the notebook, a Monarch
program's main process, a `%%mesh` cell) the root client, named "root".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch_kernel.actors.base import current_actor, current_point
from monarch_kernel.actors.identities import current_identity
from monarch_kernel.actors.procs import ProcMesh
from monarch_kernel.core.identity import ActorIdentity, root_identity
from monarch_kernel.core.shape import Point, Shape

# how the root client finds its own process as a ProcMesh (monarch_kernel.monarch.actor sets `this_proc`)
_client_proc: list[Callable[[], Any]] = []


def client_proc_from(this_proc: Callable[[], Any]) -> None:
    """Where `context().actor_instance.proc_mesh` of the root client comes from."""
    _client_proc[:] = [this_proc]


class Instance:
    """The actor running this code: its name, class, rank in the mesh it was spawned on, its processes,
    and who spawned it (`creator`, up to the root client)."""

    def __init__(self, identity: ActorIdentity, global_rank: int | None = None):
        self._identity = identity
        self._global_rank = global_rank

    @property
    def name(self) -> str:
        """The name it was spawned with ("root" for the client)."""
        return self._identity.name

    @property
    def class_name(self) -> str | None:
        """Its module-qualified class name (None for the client)."""
        return self._identity.class_name

    @property
    def rank(self) -> Point:
        """Where it was spawned, in the proc mesh it was spawned on (a point with no dims for the client)."""
        return self._identity.rank

    @property
    def creator(self) -> Instance | None:
        """The actor (or the root client) that spawned it; None for the root client."""
        creator = self._identity.creator
        return None if creator is None else Instance(creator)

    @property
    def actor_id(self) -> str:
        """A name unique to this actor instance among the processes of the client."""
        ident = self._identity
        if ident.shape is None:
            return ident.name
        where = ident.shape.ranks[ident.rank.rank]
        return f"{ident.mesh_name}[{where}].{ident.name}[{ident.rank.rank}]"

    @property
    def proc_mesh(self) -> Any:
        """The ProcMesh it was spawned on (for the client: its own process, `this_proc()`)."""
        ident = self._identity
        if ident.shape is None:
            if not _client_proc:
                raise RuntimeError("the root client's process is known once monarch_kernel.monarch.actor is imported")
            return _client_proc[0]()
        return ProcMesh(ident.mesh_name, ident.shape)

    @property
    def proc(self) -> Any:
        """Just its own process, as a ProcMesh with no dims."""
        ident = self._identity
        if ident.shape is None:
            return self.proc_mesh
        return ProcMesh(ident.mesh_name, Shape((), (ident.shape.ranks[ident.rank.rank],)))

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor, as Monarch's `abort`: raises ActorAborted, which ends the endpoint that called it and
        fails the actor (its owner hears of it, with `reason`). Call it in an endpoint of the actor."""
        if self._identity.shape is None:
            raise RuntimeError("abort() fails an actor; the root client is none: call it in an endpoint")
        raise ActorAborted(reason if reason is not None else "no reason provided")

    def __repr__(self) -> str:
        return self._identity.qualified_name()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Instance, (self._identity,))


class ActorAborted(BaseException):
    """Raised by `Instance.abort()`: a BaseException, so that the endpoint's caller cannot mistake it for an error
    of its own, and the actor fails (see rank/actor_host.py)."""


class Context:
    """What `context()` answers: the running actor (`actor_instance`) and the current message's point in
    the (sliced) mesh it was sent through (`message_rank`, what `current_rank()` tells)."""

    def __init__(self, instance: Instance, message_rank: Point):
        self._instance = instance
        self._message_rank = message_rank

    @property
    def actor_instance(self) -> Instance:
        """The actor running this code (the root client outside actors)."""
        return self._instance

    @property
    def message_rank(self) -> Point:
        """Where the current message's receiver sits in the mesh it was sent through."""
        return self._message_rank

    def __repr__(self) -> str:
        return f"<Context of {self._instance!r} at {self._message_rank}>"


class ClientContext:
    """Where `context()` outside actors comes from: the root client's Context, made at each ask, so that
    nothing is kept per thread (a program that calls context() from many short threads keeps nothing of
    them; Monarch's `_client_context`)."""

    def get(self) -> Context:
        """The root client's Context."""
        identity = root_identity()
        point = current_point.get()
        return Context(Instance(identity), point if point is not None else identity.rank)


client_context = ClientContext()


def context() -> Context:
    """The Context of the code running now: in an endpoint or constructor, its actor; elsewhere the root client."""
    if current_actor.get() is None:
        return client_context.get()
    identity = current_identity()
    point = current_point.get()
    return Context(Instance(identity), point if point is not None else identity.rank)


def current_actor_name() -> str:
    """The running actor's id, as a string (unique to the actor instance; "root" in the client)."""
    return context().actor_instance.actor_id
