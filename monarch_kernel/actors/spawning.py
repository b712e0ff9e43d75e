"""The one way an actor mesh is spawned, whoever asks: `Mesh.spawn` and `ProcMesh.spawn`, in the
notebook or inside an actor.

The spawn key, the `SpawnActors` operation and who supervises the new actor mesh are decided
here; only how the operation reaches the ranks differs (a notebook request, or the ranks'
system actors).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.actors.base import Actor, class_sources, current_actor, endpoint_parameters, owner_label
from monarch_kernel.actors.client import ActorMesh, actor_name_of
from monarch_kernel.actors.identities import current_identity
from monarch_kernel.actors.owned import record
from monarch_kernel.actors.ports import Channel, Port, PortReceiver, open_forwarding
from monarch_kernel.core.errors import MeshNotRunningError, MeshTimeoutError, MeshUsageError
from monarch_kernel.core.failures import FailureKind
from monarch_kernel.core.identity import ActorOrigin
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.supervision import MeshFailure, Owner, report_unhandled
from monarch_kernel.wire.calls import PORTS, find_sender
from monarch_kernel.wire.messages import ActorReply, BroadcastFailed, OwnActors
from monarch_kernel.wire.ops import ConstructorFailed, SpawnActors, SpawnRefused, StopActors
from monarch_kernel.wire.serialization import release, seal, unseal

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
    outcomes = ConstructorOutcomes(len(shape.ranks)) if supervise_constructor else None
    try:
        answers = run(SpawnActors(name, key, sealed, shape, class_sources(actor_class), creator,
                                  supervise_constructor, outcomes.address if outcomes is not None else None),
                      f"spawn({name!r}, {actor_class.__name__})")
    except BaseException:
        if outcomes is not None:
            outcomes.close()
        raise
    finally:
        release(sealed)
    refused = _refusals(answers)
    if refused:  # (Monarch's poisoned processes: none of the new actors stays)
        if outcomes is not None:
            outcomes.close()
        with contextlib.suppress(Exception):  # (a rank gone meanwhile took its actor with it: the refusal is the news)
            run(StopActors(key), f"stop({name!r})")
    origin = ActorOrigin(creator.qualified_name(), f"{actor_class.__module__}.{actor_class.__qualname__}", shape)
    actors = ActorMesh(mesh_name, name, actor_class.__name__, actor_class._endpoints, shape, key,
                       endpoint_parameters(actor_class), origin)
    if refused:  # as Monarch's spawn, which does not wait: the error comes from `initialized` and from each call
        said = "; ".join(f"rank {r.rank}: {r.reason}" for r in refused)
        actors.refused(f"error spawning actor mesh {name!r}: {len(refused)} of its processes take no new actors "
                       f"after an actor there failed ({said}); spawn on new processes (HostMesh.spawn_procs)")
        return actors
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

    def report(failed: ConstructorFailed) -> None:
        failure = MeshFailure(name, actor_class.__name__, failed.rank, FailureKind.EXCEPTION,
                              f"its constructor raised {failed.error_type}: {failed.message}", failed.traceback,
                              actor=actor_name_of(actors, failed.rank))
        if actors._supervised == Owner.ACTOR:
            sender.send_up(BroadcastFailed(sender.caller_id, str(owner), owner_label(str(owner), sender.caller_id),
                                           failure))
        else:
            _report_in_order(failure)

    if outcomes is not None:  # (without: a constructor that raised failed the spawn above)
        outcomes.report_to(report)  # (the owner is known now: failures that came before are reported too)
    return actors


_unreported: queue.SimpleQueue[MeshFailure] = queue.SimpleQueue()
_reporter_lock = threading.Lock()
_reporter: list[threading.Thread] = []


def _report_in_order(failure: MeshFailure) -> None:
    """Hand a failed constructor to the notebook's fault hook on a thread of its own (the hook may call actors and
    wait: never on the thread that delivers messages), one failure after another, in the order they came."""
    _unreported.put(failure)
    with _reporter_lock:
        if not _reporter:
            _reporter.append(threading.Thread(target=_report_forever, name="mesh-supervision", daemon=True))
            _reporter[0].start()


def _report_forever() -> None:
    while True:
        report_unhandled(_unreported.get())


class ConstructorOutcomes:
    """How the constructors of one Monarch spawn ended, as each rank says when its own ends (the spawn does not
    wait for them): a ConstructorFailed goes to the new mesh's owner, through `report_to`'s function, once the
    spawn knows the owner (those that came earlier wait until then). The port closes after every rank said."""

    def __init__(self, ranks: int):
        self._lock = threading.Lock()
        self._left = ranks
        self._report: Callable[[ConstructorFailed], None] | None = None
        self._early: list[ConstructorFailed] = []
        self.address, self._port_id = open_forwarding(self._arrived)

    def _arrived(self, msg: ActorReply) -> None:
        try:
            outcome = None if msg.value is None else unseal(msg.value)
        except Exception:  # noqa: BLE001 - (a value nobody sends: counted as an answer all the same)
            outcome = None
        with self._lock:
            self._left -= 1
            report = self._report
            if report is None and isinstance(outcome, ConstructorFailed):
                self._early.append(outcome)
        if self._left <= 0:
            self.close()
        if report is not None and isinstance(outcome, ConstructorFailed):
            report(outcome)

    def report_to(self, report: Callable[[ConstructorFailed], None]) -> None:
        """From now on, report each failed constructor with `report` (the ones that failed already, at once)."""
        with self._lock:
            self._report = report
            early, self._early = self._early, []
        for failed in sorted(early, key=lambda f: f.rank):
            report(failed)

    def close(self) -> None:
        """Hear no more (every rank said, or the spawn failed)."""
        PORTS.close(self._port_id)


def _refusals(answers: object) -> list[SpawnRefused]:
    """The ranks' SpawnRefused answers to a SpawnActors (a ValueMesh of them, or a list), by rank."""
    values = answers.values() if hasattr(answers, "values") else answers
    if not isinstance(values, (list, tuple)) and not hasattr(values, "__iter__"):
        return []
    return sorted((v for v in values if isinstance(v, SpawnRefused)), key=lambda v: v.rank)
