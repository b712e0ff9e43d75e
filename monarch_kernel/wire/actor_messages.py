"""The messages of actor calls, between any two processes (notebook, agents, ranks), and what a rank's
actors ask of the controller (supervision, processes of their own). `wire/messages.py` re-exports them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from monarch_kernel.core.identity import ActorOrigin
from monarch_kernel.core.supervision import MeshFailure
from monarch_kernel.wire.message_pickling import fast_pickling
from monarch_kernel.wire.serialization import Sealed


class FailureCause(enum.Enum):
    """What made a call fail, for deciding by type (`Failure.error_type` is what a user reads)."""

    RAISED = "raised"  # the endpoint raised (or its arguments could not be unpickled): error_type is the exception's
    RANK_DIED = "RankDied"  # a router answered for a rank that died before answering
    MESH_RESTARTED = "MeshRestarted"  # ... for a mesh that restarted or shut down
    MESH_NOT_RUNNING = "MeshNotRunning"  # ... for a call to a mesh this notebook does not run
    ACTOR_STOPPED = "ActorStopped"  # the actor mesh was stopped
    ACTOR_REPLACED = "ActorReplaced"  # the actor mesh was spawned again
    NO_SUCH_ENDPOINT = "AttributeError"  # the actor has no endpoint (or __supervise__) of that name
    ACTOR_FAILED = "ActorFailed"  # the actor failed (its constructor raised): it serves no calls


@dataclass(frozen=True)
class Failure:
    """An exception raised on a rank, already formatted there; `cause` says what it is, by type."""

    error_type: str
    message: str
    traceback: str
    interrupted: bool = False
    cause: FailureCause = FailureCause.RAISED

    @classmethod
    def of(cls, cause: FailureCause, message: str) -> Failure:
        """A failure the runtime made itself (not an exception of the user's code)."""
        return cls(cause.value, message, "", cause=cause)


# A slice as (dims, global ranks): its points are the endpoint's current_rank() (plain tuples: calls travel flat)
Through = tuple[tuple[tuple[str, int], ...], tuple[int, ...]]
CONTROLLER = -1  # the caller id of calls made from the notebook (ranks use their rank)
SYSTEM_ACTOR = "__procs__"  # the key of each rank's system actor, which spawns and stops actors for others


@dataclass(frozen=True)
class ActorCall:
    """Call `endpoint` of actor mesh `actor` on `ranks`; each rank answers with ActorReply.

    Routed by agents and the controller without unpickling `args` (a Sealed
    (args, kwargs) pair). `caller` and `call_id` together name the call.
    """

    caller: int
    call_id: int
    actor: str
    endpoint: str
    args: Sealed
    ranks: tuple[int, ...]
    want_value: bool = True
    to_port: bool = False  # (caller, call_id) name a Port: the replies go there, and no router waits on them
    mesh: str = ""  # the mesh of `ranks` ("": the sender's own); another mesh's calls go through the controller
    through: Through | None = None  # the slice the call was sent through (None: the mesh spawned on)
    from_mesh: str = ""  # set by the controller on a call from another mesh (its replies carry no shm files)


@dataclass(frozen=True)
class ActorReply:
    """One rank's answer to an ActorCall: a Sealed value or a Failure."""

    caller: int
    call_id: int
    rank: int
    value: Sealed | None
    failure: Failure | None
    seconds: float | None = None  # how long the endpoint ran (None: it never ran)
    to_port: bool = False  # a message sent through a Port (call_id is the port's id): no router owes it
    mesh: str = ""  # a Port's message: the mesh of the port's owner ("": the sender's own)
    aborted: str = ""  # a stopped endpoint was in a collective, ended thus ("its gloo ... closed"): regroup


@dataclass(frozen=True)
class CancelCall:
    """Stop a call on these ranks: interrupt it if running, drop it if still queued."""

    caller: int
    call_id: int
    ranks: tuple[int, ...]
    mesh: str = ""  # the mesh of `ranks`, as in ActorCall


@dataclass(frozen=True)
class DirectRoute:
    """Controller -> `ranks` (of the calling mesh): the ranks `local` of mesh `mesh` run on your machine, with
    their lanes in `shm_dir`: call their actors there directly from now on (the bridge is the way when not).
    Or, with `far`, they run on other hosts and listen for calls at (rank, address, port), where a link
    proves `key` (`rank/far_calls.py`); `shm_dir` is then ""."""

    ranks: tuple[int, ...]
    mesh: str
    shm_dir: str
    local: tuple[int, ...]
    far: tuple[tuple[int, str, int], ...] = ()
    key: bytes = b""


@dataclass(frozen=True)
class LaneRetired:
    """Rank -> a caller on an async actor's own lane (`rank/actor_lanes.py`): that actor ended. Make no new calls
    on this lane (the rank's lane takes them); the rank still answers what comes on it until the caller closes
    it, so no call in flight is lost."""


@dataclass(frozen=True)
class ListenForCalls:
    """Controller -> `ranks` (of a mesh on remote hosts that another mesh's ranks call): listen on your host's
    `address` for links that prove `key`, and serve the calls that come on them (`rank/far_calls.py`)."""

    ranks: tuple[int, ...]
    address: str
    key: bytes


@dataclass(frozen=True)
class ListeningForCalls:
    """Rank -> controller: where it listens for calls (`port` 0: it cannot, `error` says why)."""

    rank: int
    address: str
    port: int
    error: str = ""


@dataclass(frozen=True)
class OwnActors:
    """A rank's actor spawned an actor mesh: it supervises it (rank -> agent -> controller)."""

    owner_rank: int
    owner_key: str  # the owning actor's spawn key
    owner_label: str  # e.g. "Manager (actor mesh 'manager') on rank 0", for reports
    key: str  # the spawn key of the owned actor mesh
    name: str
    class_name: str
    ranks: tuple[int, ...]
    mesh: str = ""  # the owned actors' mesh when it is another than the owner's
    origin: ActorOrigin | None = None  # what names its actors in reports, as Monarch does
    known: tuple[int, int] | None = None  # a port of the rank (owner, id): told once the controller knows the owner


@dataclass(frozen=True)
class BroadcastFailed:
    """A broadcast that an actor sent failed on a rank: the sender's `__supervise__` hears of it, as in
    Monarch (rank -> agent -> controller, which asks the sender as it asks owners)."""

    sender_rank: int
    sender_key: str  # the sending actor's spawn key
    sender_label: str
    failure: MeshFailure


@dataclass(frozen=True)
class ActorFailed:
    """An actor failed on its rank (an endpoint raised what ends an actor, as in Monarch: a BaseException, or any
    exception of an endpoint that answers through its own port): its owner hears of it (rank -> agent ->
    controller, which asks an owning actor's `__supervise__`, or the notebook's fault hook). The rank answers
    the failed call once the owner has heard (`heard`), so that a caller that owns the actor finds its
    `__supervise__` done when the call raises, as in Monarch."""

    rank: int
    key: str  # the failed actor mesh's spawn key
    failure: MeshFailure
    heard: tuple[int, int] | None = None  # a port of the rank (owner, id): told once the owner has heard of it


@dataclass(frozen=True)
class StartProcs:
    """Start `per_host` processes on the asking rank's host (with its mesh's settings unless `options` differ)."""

    per_host: tuple[tuple[str, int], ...]
    name: str  # "" for a generated one
    options: Sealed  # a dict: dist, env, preload, timeout, ...


@dataclass(frozen=True)
class StopProcs:
    """Stop processes that an actor started (a mesh named `mesh`)."""

    mesh: str


@dataclass(frozen=True)
class GetController:
    """Monarch's `get_or_spawn_controller(name, cls, ...)` asked in an endpoint: the one actor of that name that
    the notebook keeps (spawned now, on its `this_proc()`, if there is none yet)."""

    name: str
    actor: Sealed  # (class, args, kwargs)


@dataclass(frozen=True)
class ProcsRequest:
    """An actor starts or stops processes of its own, as Monarch allows (`this_host().spawn_procs(...)` in an
    endpoint): rank -> agent -> controller, which does it as the notebook does and answers through the
    rank's port `reply_to` (owner, id) with the new mesh's (name, shape), None after a stop, or the
    controller's ActorMesh."""

    rank: int
    reply_to: tuple[int, int]
    op: StartProcs | StopProcs | GetController


ForSupervisors = OwnActors | BroadcastFailed | ActorFailed | ProcsRequest  # what a rank tells its controller of its actors


fast_pickling(vars().values(), __name__)
