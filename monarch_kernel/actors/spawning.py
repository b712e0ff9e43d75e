"""The one way an actor mesh is spawned, whoever asks: `Mesh.spawn` and `ProcMesh.spawn`, in the
notebook or inside an actor.

The spawn key, the `SpawnActors` operation and who supervises the new actor mesh are decided
here; only how the operation reaches the ranks differs (a notebook request, or the ranks'
system actors).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

from monarch_kernel.actors.base import Actor, class_sources, current_actor, endpoint_parameters, owner_label
from monarch_kernel.actors.client import ActorMesh, actor_name_of
from monarch_kernel.actors.identities import current_identity
from monarch_kernel.actors.owned import record
from monarch_kernel.actors.ports import Channel, Port, PortReceiver
from monarch_kernel.core.errors import MeshNotRunningError, MeshTimeoutError, MeshUsageError
from monarch_kernel.core.failures import FailureKind
from monarch_kernel.core.identity import ActorOrigin
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.supervision import MeshFailure, Owner, report_unhandled
from monarch_kernel.wire.calls import find_sender
from monarch_kernel.wire.messages import BroadcastFailed, OwnActors
from monarch_kernel.wire.ops import ConstructorFailed, SpawnActors, SpawnRefused, StopActors
from monarch_kernel.wire.serialization import release, seal

_spawns = itertools.count(1)
OWNED_STOP_S = 60.0  # how long stopping an actor waits for each actor mesh it owns to stop
OWNER_KNOWN_S = 10.0  # how long an actor's spawn waits for the controller to note that the actor owns the new mesh
RunSpawn = Callable[[SpawnActors | StopActors, str], object]  # (operation, label): runs it on the shape's ranks; raises


def spawn_actor_mesh(mesh_name: str, shape: Shape, name: str, actor_class: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], run: RunSpawn, *, notebook_hook: bool = True,
                     supervise_constructor: bool = False) -> ActorMesh:
    """One `actor_class(*args, **kwargs)` per rank of `shape`, as actor mesh `name`; its handle.

    Spawned inside an actor, that actor owns (and supervises) it. Spawned in the notebook
    with `notebook_hook` (Monarch's way: ProcMesh.spawn), the notebook's fault hook hears its
    failures; without (`Mesh.spawn`), failed broadcasts are shown with the mesh's output and
    dead ranks in the mesh's own notices.

    A constructor that raises fails the spawn, unless `supervise_constructor` (Monarch's way): then the
    spawn returns, each rank where it raised is reported to the owner (`__supervise__` or the fault hook)
    as a MeshFailure, and calls to those actors raise SupervisionError with the constructor's traceback.
    """
    if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
        raise MeshUsageError(f"spawn() needs a subclass of monarch_kernel.Actor, got {actor_class!r}")
    if not name or not isinstance(name, str):
        raise MeshUsageError("spawn() needs a name for the actor mesh, e.g. procs.spawn('trainers', Trainer)")
    sender = find_sender(mesh_name)
    if sender is None:
        raise MeshNotRunningError(f"the processes of mesh {mesh_name!r} are gone (it was stopped or lost)")
    key = f"{name}#{sender.caller_id}.{next(_spawns)}"
    creator = current_identity()
    sealed = seal((actor_class, args, kwargs), shm_dir=sender.shm_dir_for(shape.ranks), shared=True)
    try:
        answers = run(SpawnActors(name, key, sealed, shape, class_sources(actor_class), creator,
                                  supervise_constructor), f"spawn({name!r}, {actor_class.__name__})")
    finally:
        release(sealed)
    refused = _answers_of(answers, SpawnRefused)
    if refused:  # (Monarch's poisoned processes: none of the new actors stays)
        with contextlib.suppress(Exception):  # (a rank gone meanwhile took its actor with it: the refusal is the news)
            run(StopActors(key), f"stop({name!r})")
        said = "; ".join(f"rank {r.rank}: {r.reason}" for r in refused)
        raise RuntimeError(f"error spawning actor mesh {name!r}: {len(refused)} of its processes take no new actors "
                           f"after an actor there failed ({said}); spawn on new processes (HostMesh.spawn_procs)")
    origin = ActorOrigin(creator.qualified_name(), f"{actor_class.__module__}.{actor_class.__qualname__}", shape)
    actors = ActorMesh(mesh_name, name, actor_class.__name__, actor_class._endpoints, shape, key,
                       endpoint_parameters(actor_class), origin)
    owner = current_actor.get()
    if owner is not None and sender.own_rank is not None:  # an actor spawned it: the controller routes its failures
        actors._supervised = Owner.ACTOR
        record(owner, f"actor mesh {name!r}", lambda: actors.stop(timeout=OWNED_STOP_S))  # (stopped with its owner)
        known: Port[None]
        receiver: PortReceiver[None]
        known, receiver = Channel.open(once=True)
        sender.send_up(OwnActors(sender.caller_id, owner, owner_label(owner, sender.caller_id), key, name,
                                 actor_class.__name__, shape.ranks,
                                 mesh_name if sender.other_mesh(mesh_name) else "", origin,
                                 (known._owner, known._port_id)))
        # the spawn returns once the controller knows the owner: a failure of the new actors (a death reported
        # by their own host, on another path than this rank's) then always finds who hears of it
        with contextlib.suppress(MeshTimeoutError):
            receiver.recv().get(timeout=OWNER_KNOWN_S)
    elif sender.own_rank is None and notebook_hook:  # the notebook owns it
        actors.supervise_from_notebook()
    for failed in _constructor_failures(answers):
        failure = MeshFailure(name, actor_class.__name__, failed.rank, FailureKind.EXCEPTION,
                              f"its constructor raised {failed.error_type}: {failed.message}", failed.traceback,
                              actor=actor_name_of(actors, failed.rank))
        if actors._supervised == Owner.ACTOR:
            sender.send_up(BroadcastFailed(sender.caller_id, str(owner), owner_label(str(owner), sender.caller_id),
                                           failure))
        else:
            report_unhandled(failure)
    return actors


def _constructor_failures(answers: object) -> list[ConstructorFailed]:
    """The ranks' ConstructorFailed answers to a SpawnActors (a ValueMesh of them, or a list)."""
    return _answers_of(answers, ConstructorFailed)


T = TypeVar("T", ConstructorFailed, SpawnRefused)


def _answers_of(answers: object, kind: type[T]) -> list[T]:
    """The ranks' answers of one kind to a SpawnActors (a ValueMesh of them, or a list), by rank."""
    values = answers.values() if hasattr(answers, "values") else answers
    if not isinstance(values, (list, tuple)) and not hasattr(values, "__iter__"):
        return []
    return sorted((v for v in values if isinstance(v, kind)), key=lambda v: v.rank)
