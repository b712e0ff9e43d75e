"""Wire messages between controller, host agent and ranks (frozen dataclasses).

User values inside messages are `Sealed` blobs, so the host agent can route a message
without unpickling what the user sent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

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
    """Run a pickled function fn(namespace, *args, **kwargs) on a rank (internal ops)."""

    req_id: int
    fn: Sealed


# ---------------------------------------------------------------- rank -> controller


@dataclass(frozen=True)
class Failure:
    """An exception raised on a rank, already formatted there."""

    error_type: str
    message: str
    traceback: str
    interrupted: bool = False


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
    """Work for the agent itself, not its ranks (workspace files: `agent.workspace`).

    `args` holds plain data; file contents travel as out-of-band buffers (PickleBuffer).
    """

    op_id: int
    kind: str
    args: dict[str, Any]


@dataclass(frozen=True)
class HostOpDone:
    """The agent's answer to a HostOp: its result, or what went wrong."""

    op_id: int
    result: Any
    error: str = ""


# ---------------------------------------------------------------- relays (wire/relay_link.py)


@dataclass(frozen=True)
class RelayServe:
    """Controller -> a relay agent: listen on `address` for these child hosts (they prove `key`).

    `routes` says, for each host below this one, which child leads to it."""

    key: bytes
    address: str
    index: int  # this host's index
    children: tuple[int, ...]
    routes: tuple[tuple[int, int], ...]  # (descendant host, child host)


@dataclass(frozen=True)
class RelayListening:
    """A relay agent -> controller: it listens on this port of this numeric address (0: it could not, see `error`)."""

    port: int
    error: str = ""
    address: str = ""


@dataclass(frozen=True)
class RelayJoin:
    """Controller -> a child agent: connect to your relay parent, proving `key` as host `index`."""

    address: str
    port: int
    key: bytes
    index: int


@dataclass(frozen=True)
class RelayJoined:
    """A child agent -> controller: its link to the parent is up (or not: `error`)."""

    index: int
    error: str = ""


@dataclass(frozen=True)
class RelayLost:
    """An agent -> controller: the relay link to host `host` broke (that host's subtree is cut off)."""

    host: int
    why: str


@dataclass(frozen=True)
class RelayStop:
    """Controller -> agents: close your relay links (setting them up failed; the controller sends directly)."""


@dataclass(frozen=True)
class RelayDown:
    """Down a relay tree: ToRanks(ranks, body) for each (host, ranks), the body encoded once per link."""

    hosts: tuple[tuple[int, tuple[int, ...]], ...]
    body: Any


@dataclass(frozen=True)
class RelayUp:
    """Up a relay tree: what agents below sent (output and results), batched per hop, results of one
    request combined."""

    msgs: tuple[Any, ...]


# ---------------------------------------------------------------- actor calls (any -> any)

CONTROLLER = -1  # the caller id of calls made from the notebook (ranks use their rank)


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


@dataclass(frozen=True)
class CancelCall:
    """Stop a call on these ranks: interrupt it if running, drop it if still queued."""

    caller: int
    call_id: int
    ranks: tuple[int, ...]


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


# ---------------------------------------------------------------- fast pickling


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    """Recreate a message without the frozen dataclass __init__ (about twice as fast)."""
    obj: Any = object.__new__(cls)
    obj.__dict__.update(zip(_field_names(cls), values))
    return obj


def _reduce(self: Any) -> tuple[Any, ...]:
    return (_rebuild, (type(self), tuple(self.__dict__.values())))


for _cls in list(globals().values()):
    if isinstance(_cls, type) and _cls.__module__ == __name__ and is_dataclass(_cls):
        setattr(_cls, "__reduce__", _reduce)  # noqa: B010 - mypy refuses to assign a method


# ---------------------------------------------------------------- flat frames
# The messages of every cell and actor call travel as a plain tuple (tag, field values):
# a tuple of ints, strings and bytes pickles about four times faster, both ways, than
# objects whose pickles name a class and a rebuild function. Tags are positions in
# FLAT_TYPES, the same in every process (all import this module).

FLAT_TYPES: tuple[type, ...] = (RunCell, Push, Pull, Call, Result, Output, ToRanks, Gathered, Ping, Pong,
                                ActorCall, ActorReply, CancelCall)
_TAGS = {cls: tag for tag, cls in enumerate(FLAT_TYPES)}
_NESTED = {ToRanks: "body", Gathered: "results"}  # fields holding a message / messages
_SEALED = {cls: tuple(i for i, f in enumerate(fields(cls)) if "Sealed" in str(f.type)) for cls in FLAT_TYPES}
_NESTED_AT = {cls: _field_names(cls).index(name) for cls, name in _NESTED.items()}
_NOT_FLAT = -1


def flatten(msg: Any) -> tuple[Any, ...] | None:
    """A message as a flat tuple (None if its type does not travel flat)."""
    cls = type(msg)
    tag = _TAGS.get(cls)
    if tag is None:
        return None
    values = list(msg.__dict__.values())
    for i in _SEALED[cls]:
        if values[i] is not None:
            values[i] = values[i].parts()
    at = _NESTED_AT.get(cls)
    if at is not None:
        inner = values[at]
        if cls is Gathered:
            values[at] = tuple(flatten(r) or (_NOT_FLAT, r) for r in inner)
        else:
            values[at] = flatten(inner) or (_NOT_FLAT, inner)
    return (tag, *values)


def unflatten(flat: tuple[Any, ...]) -> Any:
    """The message a flat tuple stands for."""
    tag = flat[0]
    if tag == _NOT_FLAT:
        return flat[1]
    cls = FLAT_TYPES[tag]
    values = list(flat[1:])
    for i in _SEALED[cls]:
        if values[i] is not None:
            values[i] = Sealed.from_parts(values[i])
    at = _NESTED_AT.get(cls)
    if at is not None:
        inner = values[at]
        values[at] = tuple(unflatten(r) for r in inner) if cls is Gathered else unflatten(inner)
    obj: Any = object.__new__(cls)  # as _rebuild does, inline: this runs for every message
    obj.__dict__.update(zip(_field_names(cls), values))
    return obj
