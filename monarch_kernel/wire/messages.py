"""Wire messages between controller, host agent and ranks (frozen dataclasses).

User values inside messages are `Sealed` blobs, so the host agent can route a message
without unpickling what the user sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.wire import ops
from monarch_kernel.wire.actor_messages import (  # re-exported: `m.ActorCall`, `m.Failure` and the rest
    CONTROLLER as CONTROLLER,
)
from monarch_kernel.wire.actor_messages import (
    ActorCall as ActorCall,
)
from monarch_kernel.wire.actor_messages import (
    ActorFailed as ActorFailed,
)
from monarch_kernel.wire.actor_messages import (
    ActorReply as ActorReply,
)
from monarch_kernel.wire.actor_messages import (
    BroadcastFailed as BroadcastFailed,
)
from monarch_kernel.wire.actor_messages import (
    CancelCall as CancelCall,
)
from monarch_kernel.wire.actor_messages import (
    DirectRoute as DirectRoute,
)
from monarch_kernel.wire.actor_messages import (
    Failure as Failure,
)
from monarch_kernel.wire.actor_messages import (
    FailureCause as FailureCause,
)
from monarch_kernel.wire.actor_messages import (
    ForSupervisors as ForSupervisors,
)
from monarch_kernel.wire.actor_messages import (
    GetController as GetController,
)
from monarch_kernel.wire.actor_messages import (
    LaneRetired as LaneRetired,
)
from monarch_kernel.wire.actor_messages import (
    ListenForCalls as ListenForCalls,
)
from monarch_kernel.wire.actor_messages import (
    ListeningForCalls as ListeningForCalls,
)
from monarch_kernel.wire.actor_messages import (
    OwnActors as OwnActors,
)
from monarch_kernel.wire.actor_messages import (
    ProcsRequest as ProcsRequest,
)
from monarch_kernel.wire.actor_messages import (
    StartProcs as StartProcs,
)
from monarch_kernel.wire.actor_messages import (
    StopProcs as StopProcs,
)
from monarch_kernel.wire.actor_messages import (
    Through as Through,
)
from monarch_kernel.wire.message_pickling import fast_pickling
from monarch_kernel.wire.ops import HostOperation, HostOperationResult, RankOperation
from monarch_kernel.wire.serialization import Sealed

# ---------------------------------------------------------------- controller -> rank


@dataclass(frozen=True)
class RunCell:
    """Execute cell source on a rank; reply with the last expression's value."""

    req_id: int
    code: str
    filename: str


@dataclass(frozen=True)
class Push:
    """Assign names in each rank's namespace: values is a Sealed dict."""

    req_id: int
    values: Sealed


@dataclass(frozen=True)
class Pull:
    """Evaluate an expression in each rank's namespace and reply with its value."""

    req_id: int
    expr: str


@dataclass(frozen=True)
class Call:
    """Run the user's pickled function fn() on a rank (`Mesh.call`) and reply with its value."""

    req_id: int
    fn: Sealed


@dataclass(frozen=True)
class RunOp:
    """An internal operation on a rank (`wire/ops.py`, handled by `rank/ops.py`); reply with its answer."""

    req_id: int
    op: RankOperation


# ---------------------------------------------------------------- rank -> controller


@dataclass(frozen=True)
class Result:
    """One rank's reply to a request: a Sealed value or a Failure.

    fd_mark: for a request that came on a lane, how many bytes of the rank's fd output its
    agent had passed on when it ended (the controller books the result after seeing them).
    """

    req_id: int
    rank: int
    value: Sealed | None
    failure: Failure | None
    started: float
    finished: float
    fd_mark: int = 0


@dataclass(frozen=True)
class Output:
    """Text a rank wrote to stdout/stderr while handling request req_id (None: idle, or fd output).

    fd_total: for fd output on the notebook's machine, the rank's fd bytes passed on so far.
    """

    rank: int
    req_id: int | None
    stream: str
    text: str
    fd_total: int | None = None


@dataclass(frozen=True)
class InputRequest:
    """A cell on a rank called input() (pdb too) or getpass(): ask the notebook for a line."""

    rank: int
    req_id: int
    prompt: str
    password: bool = False


@dataclass(frozen=True)
class InputReply:
    """The line the notebook typed for these ranks' input() in request req_id, or why there is none."""

    ranks: tuple[int, ...]
    req_id: int
    text: str
    error: str | None = None


@dataclass(frozen=True)
class Display:
    """A rich display (MIME bundle) produced on a rank."""

    rank: int
    req_id: int | None
    data: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- controller -> agent


@dataclass(frozen=True)
class DistConfig:
    """How ranks set up torch.distributed."""

    backend: str  # "gloo", "nccl" or "none"
    master_addr: str
    world_size: int
    timeout_s: float = 300.0


@dataclass(frozen=True)
class RankSpec:
    """One rank to start on a host."""

    rank: int
    local_rank: int
    local_world_size: int
    bind: tuple[tuple[str, str], ...] = ()  # its CPU and NUMA pinning (spawn_procs' proc_bind; core/proc_bind.py)
    env: tuple[tuple[str, str], ...] = ()  # its own environment variables, over the mesh's (bootstrap_command)


@dataclass(frozen=True)
class HealthTimings:
    """How soon silence counts as failure, in seconds (per mesh; tests shrink them)."""

    ping_interval_s: float = 1.0  # controller -> each agent
    # controller: an agent silent this long is *unreachable*: said once, its ranks and link kept
    # (a stalled network, a saturated NIC); it is *lost* (its ranks' work fails, the link is
    # closed, which stops them) only when silent for host_lost_after_s, or when its link closes
    host_unreachable_after_s: float = 3.0
    host_lost_after_s: float = 15.0
    heartbeat_interval_s: float = 0.5  # agent -> each rank
    unresponsive_after_s: float = 2.5  # agent: a rank silent this long is unresponsive
    # SSH agent: a controller silent this long is gone, so its ranks stop. Long, because a
    # kernel busy in a C call that holds the GIL is silent too, and must find its mesh intact.
    controller_silence_s: float = 900.0


@dataclass(frozen=True)
class StartRanks:
    """Start (or restart) this host's ranks."""

    ranks: tuple[RankSpec, ...]
    dist: DistConfig
    env: dict[str, str]
    shm_dir: str | None
    node_rank: int = 0
    master_port: int = 0
    health: HealthTimings = HealthTimings()
    mesh: str = ""  # the mesh's name (calls naming another mesh go through the controller)


@dataclass(frozen=True)
class Preload:
    """Modules to import before forking ranks (the controller's first message to an agent)."""

    modules: tuple[str, ...]


@dataclass(frozen=True)
class BindStore:
    """Bind rank 0's rendezvous socket on this host (to addr); answered by StoreBound."""

    addr: str


@dataclass(frozen=True)
class StoreBound:
    """The port rank 0's rendezvous store will listen on."""

    port: int


@dataclass(frozen=True)
class ToRanks:
    """Deliver `body` to the given local ranks; gather their Results into one reply."""

    ranks: tuple[int, ...]
    body: Any


@dataclass(frozen=True)
class InterruptRanks:
    """Stop requests on the given local ranks: KeyboardInterrupt in them now if they run, at their
    start if they have not started yet (the agent passes this on to each rank, which decides).

    running: also interrupt whatever user code the rank runs now (the notebook's stop button).
    """

    ranks: tuple[int, ...]
    req_ids: tuple[int, ...]
    running: bool = False


@dataclass(frozen=True)
class Ping:
    """Liveness probe; the agent answers with Pong(seq)."""

    seq: int


@dataclass(frozen=True)
class Shutdown:
    """Stop all ranks and exit."""


# ---------------------------------------------------------------- agent -> controller


@dataclass(frozen=True)
class RankInfo:
    """A started rank: where it runs."""

    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class RanksStarted:
    """All ranks of a host are running and ready for work."""

    ranks: tuple[RankInfo, ...]


@dataclass(frozen=True)
class RanksFailed:
    """Ranks could not be started; text explains why."""

    text: str


@dataclass(frozen=True)
class Gathered:
    """Results of one request from all of a host's ranks that answered."""

    req_id: int
    results: tuple[Result, ...]


@dataclass(frozen=True)
class RankExited:
    """A rank process ended (exit code, or the signal that killed it)."""

    rank: int
    pid: int
    exit_code: int | None
    signal: str | None
    stderr_tail: tuple[str, ...]
    expected: bool


@dataclass(frozen=True)
class RankHealth:
    """A rank stopped (or resumed) answering heartbeats."""

    rank: int
    responsive: bool


@dataclass(frozen=True)
class HostLoad:
    """Each rank's load on this host (RankLoad records), about once a second."""

    loads: tuple[Any, ...]


@dataclass(frozen=True)
class Pong:
    """Answer to Ping."""

    seq: int


@dataclass(frozen=True)
class AgentProblem:
    """The agent failed at something of its own (not a rank's code) and carried on: shown to the user."""

    text: str


# ---------------------------------------------------------------- host operations (controller <-> agent)


@dataclass(frozen=True)
class HostOp:
    """Work for the agent itself, not its ranks (`wire/ops.py`: files, workspace copies).

    File contents travel as out-of-band buffers (PickleBuffer).
    """

    op_id: int
    op: HostOperation


@dataclass(frozen=True)
class HostOpDone:
    """The agent's answer to a HostOp: its result, or what went wrong."""

    op_id: int
    result: HostOperationResult | None
    error: str = ""


fast_pickling(vars().values(), __name__)
fast_pickling(ops.RANK_OPERATIONS + ops.HOST_OPERATIONS + ops.HOST_OPERATION_RESULTS, ops.__name__)
