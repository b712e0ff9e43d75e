"""The internal operations between processes: one frozen dataclass per operation.

These are what the runtime asks of the other side for itself (the user's own code travels
as cells, pushes, pulls, `Mesh.call` functions and actor calls). Each side handles them
through a table keyed by type: a rank in `rank/ops.py` (sent as a `RunOp` request, or to
the rank's system actor by another rank), a host agent in `agent/ops.py` (sent as a
`HostOp`). The wire protocol's digest (`wire/handshake.py`) covers every class here, so a
host whose monarch_kernel has other operations is refused when it connects.

User objects inside an operation (an actor class and its arguments, a plan's functions)
are `Sealed`, so whoever routes the operation never unpickles them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeGuard, TypeVar, get_args, get_origin

from monarch_kernel.core.identity import ActorIdentity
from monarch_kernel.core.shape import Shape
from monarch_kernel.wire.serialization import Sealed

Answer = TypeVar("Answer")

# ---------------------------------------------------------------- rank operations


@dataclass(frozen=True)
class SpawnActors:
    """Create this rank's actor of actor mesh `name` (`actor`: the sealed (class, args, kwargs)).

    Answer: the spawn key. `sources` are the class's source lines by file, for tracebacks.
    """

    name: str
    key: str
    actor: Sealed
    shape: Shape
    sources: dict[str, list[str]]
    creator: ActorIdentity | None = None  # who spawns it (its `context().actor_instance.creator`)
    # Monarch's way (ProcMesh.spawn): a constructor that raises fails this rank's actor, which then answers every
    # call with that failure, and the answer is a ConstructorFailed (else the spawn fails with the exception)
    supervise_constructor: bool = False
    # Monarch's spawn, which does not wait for constructors: the rank answers once the actor's mailbox is there (calls
    # that come wait in it) and sends how the constructor ended, a ConstructorFailed or the answer above, through
    # this port (owner, port id, mesh) when it ends; None: the answer waits for the constructor
    outcome_port: tuple[int, int, str] | None = None


@dataclass(frozen=True)
class ConstructorFailed:
    """SpawnActors' answer (or outcome, with outcome_port) on a rank where the actor's constructor raised (with
    supervise_constructor)."""

    rank: int
    error_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class SpawnRefused:
    """SpawnActors' answer (with supervise_constructor: Monarch's ProcMesh.spawn) on a process where an actor failed
    before: as Monarch's poisoned process, it takes no new actors; `reason` says which failed first."""

    rank: int
    reason: str


@dataclass(frozen=True)
class StopActors:
    """Stop this rank's actor of the spawn `key`. Answer: whether it was there."""

    key: str


@dataclass(frozen=True)
class FailActor:
    """The actor of spawn `key` on this rank fails, as in Monarch: a failure of an actor mesh it owns reached it
    and it did not handle it (its `__supervise__` returned a false value or raised, or it has none). Its calls,
    running and to come, are answered with `report`. Answer: whether it was there."""

    key: str
    report: str


@dataclass(frozen=True)
class StopAllActors:
    """Stop every actor on this rank (each one's concurrent tasks cancelled, then its `__cleanup__`), then run the
    user's exit work (`rank/exit_work.py`), as its processes are about to end. Answer: how many actor meshes
    there were."""


@dataclass(frozen=True)
class Describe:
    """Metadata of what `expr` is on the rank (tensor, DTensor or module). Answer: a `core.sharding.TensorDescription`,
    or [(parameter name, TensorDescription), ...] for a module."""

    expr: str


@dataclass(frozen=True)
class PostMortem:
    """pdb at the error of the rank's last failed cell, or with `in_debugger` the visual debugger
    running in the rank (JupyterLab's panels) at that frame. Answer: False if it had none."""

    in_debugger: bool = False


@dataclass(frozen=True)
class HasFailedCell:
    """Whether the rank's last cell failed (its error is kept for post-mortem). Answer: a bool."""


@dataclass(frozen=True)
class UseWorkspace:
    """Put a synced folder first on sys.path (and make it the working folder with `chdir`).

    `folder`: the notebook's own folder (a rank on the notebook's machine), or None for the
    host's private copy named by `key`. Answer: the folder used.
    """

    folder: str | None
    key: str
    chdir: bool


@dataclass(frozen=True)
class SetAutoreload:
    """Reload changed modules of the synced folders before each cell (or stop). Answer: `on`."""

    on: bool


@dataclass(frozen=True)
class Versions:
    """The rank's Python and package versions. Answer: name -> version."""


@dataclass(frozen=True)
class ApplyLayout:
    """Build the plan's model in `layout` on the rank and bind (model, optimizer, step) to `names`.

    `plan`: the sealed (ModelSpec, batch or None). Answer: the layout's text.
    """

    plan: Sealed
    layout: str
    names: tuple[str, str, str]


@dataclass(frozen=True)
class MeasureRank:
    """Measure the rank for the planner: its matmul throughput, operator costs, the memory it may use
    and the mesh's links (collectives with the other ranks). Answer: `planner.measure.RankFigures`."""


@dataclass(frozen=True)
class TrialLayout:
    """Build the plan's model in `layout` for real and run `steps` training steps on the rank (every rank
    of the mesh at once). `plan`: the sealed (TrainingSpec, batch). Answer: `planner.measure.TrialMeasurement`."""

    plan: Sealed
    layout: str
    steps: int


@dataclass(frozen=True)
class CollectGarbage:
    """Run Python's garbage collector on the rank (after trials: their models' cycles go). Answer: objects freed."""


@dataclass(frozen=True)
class SetLogLevel:
    """Set the level of the rank's root logger (`ProcMesh.logging_option(level=...)`). Answer: None."""

    level: int


@dataclass(frozen=True)
class RemakeDefaultGroup:
    """Destroy this rank's process groups and make the default one anew through the mesh's store,
    under `key` (the same on every rank), after a stop ended collectives in progress. Answer: how
    the groups made in cells were named (they are gone)."""

    key: str


@dataclass(frozen=True)
class StartProfile:
    """Start torch.profiler on the rank (`%%mesh --profile`). Answer: True."""


@dataclass(frozen=True)
class StopProfile:
    """Stop it. Answer: `ProfileTrace`."""


@dataclass(frozen=True)
class ProfileTrace:
    """A rank's profile: its chrome trace's events, their time base (microseconds of its wall clock), and its
    top operations by self time, (name, calls, self microseconds)."""

    events: list[dict[str, Any]]
    base_us: float
    ops: list[tuple[str, int, float]]


@dataclass(frozen=True)
class ReadClock:
    """The rank's wall clock in microseconds (to line the ranks' traces up)."""


@dataclass(frozen=True)
class ListActorMeshes:
    """The actor meshes on the rank (for a kernel that attached to a mesh it did not start).
    Answer: name -> `ActorMeshEntry`."""


@dataclass(frozen=True)
class ActorMeshEntry:
    """One actor mesh a rank serves: its spawn key, class name, endpoints with their parameters, and shape."""

    key: str
    class_name: str
    endpoints: frozenset[str]
    parameters: dict[str, Any]
    shape: Shape


@dataclass(frozen=True)
class StartDebugger:
    """Start the visual debugger (debugpy's pydevd) in the rank for DAP session `session`, on the rank's
    main thread, linked to the rank itself only (`rank/debugging.py`). Answer: `DebuggerStarted`."""

    session: int


@dataclass(frozen=True)
class DebuggerStarted:
    """StartDebugger's answer: the rank's process id and the DAP session it serves."""

    rank: int
    pid: int
    session: int


@dataclass(frozen=True)
class StopDebugger:
    """End the rank's visual debugger (its threads run on untraced). Answer: whether one was running."""


RankOperation = (SpawnActors | StopActors | FailActor | StopAllActors | Describe | PostMortem | HasFailedCell | UseWorkspace
                 | SetAutoreload | Versions | ApplyLayout | MeasureRank | TrialLayout | CollectGarbage | SetLogLevel
                 | RemakeDefaultGroup | StartProfile | StopProfile | ReadClock | ListActorMeshes | StartDebugger
                 | StopDebugger)
RANK_OPERATIONS: tuple[type, ...] = get_args(RankOperation)  # (the list is written once, as the union)
ACTOR_OPERATIONS: tuple[type, ...] = (SpawnActors, StopActors, FailActor)  # what a rank's system actor takes

# ---------------------------------------------------------------- what the agent answers to host operations


@dataclass(frozen=True)
class PutStarted:
    """What an earlier, interrupted put of the file left: `partial` bytes whose sha256 is `sha256` (0, "": none),
    and the path the file will have."""

    partial: int
    sha256: str
    path: str


@dataclass(frozen=True)
class ChunkWritten:
    """A put's chunk is written; the partial file now ends at `end`."""

    end: int


@dataclass(frozen=True)
class PutFinished:
    """The put's file is in place at `path`."""

    path: str


@dataclass(frozen=True)
class PathListing:
    """A path to get: its files (relative path -> size; "" for the path itself when it is a file) and their modes."""

    path: str
    folder: bool
    files: dict[str, int]
    modes: dict[str, int]


@dataclass(frozen=True)
class ChunkRead:
    """Bytes of a file (a PickleBuffer: they travel out of band)."""

    data: Any


@dataclass(frozen=True)
class FileChecksum:
    """A file's sha256 and size."""

    sha256: str
    size: int


@dataclass(frozen=True)
class PrefixChecksum:
    """The sha256 of a file's first bytes."""

    sha256: str


@dataclass(frozen=True)
class WorkspaceListing:
    """A host's copy of a workspace: its folder, its files (path -> (size, mtime_ns, mode)) and the id of the
    filesystem it lies on (hosts that share one are written once)."""

    root: str
    files: dict[str, tuple[int, int, int]]
    fsid: str


@dataclass(frozen=True)
class WorkspaceHashes:
    """The sha256 of each file asked for (path -> hex digest)."""

    hashes: dict[str, str]


@dataclass(frozen=True)
class WorkspaceWritten:
    """What a WriteFiles did: files completed, bytes written, files deleted, and a line per file that failed."""

    root: str
    written: int
    bytes: int
    deleted: int
    errors: list[str]


@dataclass(frozen=True)
class NativeStacksFound:
    """py-spy's dump per pid, or (`missing`) why there is none on this host."""

    stacks: dict[int, str]
    missing: str = ""


HostOperationResult = (PutStarted | ChunkWritten | PutFinished | PathListing | ChunkRead | FileChecksum
                       | PrefixChecksum | WorkspaceListing | WorkspaceHashes | WorkspaceWritten | NativeStacksFound)
HOST_OPERATION_RESULTS: tuple[type, ...] = get_args(HostOperationResult)


# ---------------------------------------------------------------- host operations (the agent's own files)


class Answering(Generic[Answer]):
    """A host operation whose answer is an `Answer` (the agent's handler returns one; `HostOps.send`'s future
    holds it, and refuses anything else)."""

    answer: ClassVar[type]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if get_origin(base) is Answering:
                cls.answer = get_args(base)[0]

@dataclass(frozen=True)
class PutBegin(Answering[PutStarted]):
    """A put of one file begins. Answer: `PutStarted` (what an earlier, interrupted put left)."""

    path: str
    size: int


@dataclass(frozen=True)
class PutChunk(Answering[ChunkWritten]):
    """Bytes of a put at `offset` (`data` travels out of band). Answer: `ChunkWritten`."""

    path: str
    offset: int
    data: Any


@dataclass(frozen=True)
class PutEnd(Answering[PutFinished]):
    """A put is complete: check the whole file's sha256, then put it in place with its mode and time.
    Answer: `PutFinished`."""

    path: str
    size: int
    sha256: str
    mode: int
    mtime_ns: int


@dataclass(frozen=True)
class DescribePath(Answering[PathListing]):
    """What a get will fetch: one file, or a folder's files, with sizes and modes. Answer: `PathListing`."""

    path: str


@dataclass(frozen=True)
class ReadChunk(Answering[ChunkRead]):
    """Bytes of a file from `offset`. Answer: `ChunkRead`."""

    path: str
    offset: int
    size: int


@dataclass(frozen=True)
class Checksum(Answering[FileChecksum]):
    """A file's sha256 and size. Answer: `FileChecksum`."""

    path: str


@dataclass(frozen=True)
class PrefixDigest(Answering[PrefixChecksum]):
    """The sha256 of a file's first `length` bytes (to resume a get). Answer: `PrefixChecksum`."""

    path: str
    length: int


@dataclass(frozen=True)
class ListFiles(Answering[WorkspaceListing]):
    """Every file of the host's copy of workspace `key`. Answer: `WorkspaceListing`."""

    key: str


@dataclass(frozen=True)
class HashFiles(Answering[WorkspaceHashes]):
    """The sha256 of each named file of workspace `key`'s copy. Answer: `WorkspaceHashes`."""

    key: str
    paths: list[str]


@dataclass(frozen=True)
class WriteFiles(Answering[WorkspaceWritten]):
    """Apply chunks (rel, mode, mtime_ns, offset, total size, data), deletions and mtime fixes to a copy.
    Answer: `WorkspaceWritten`."""

    key: str
    files: list[tuple[str, int, int, int, int, Any]]
    deletes: list[str]
    touches: dict[str, int] | None = None


@dataclass(frozen=True)
class NativeStacks(Answering[NativeStacksFound]):
    """Native and Python stacks of these processes of the host, from py-spy (`%mesh stacks --native`).
    Answer: `NativeStacksFound`."""

    pids: tuple[int, ...]


HostOperation = (PutBegin | PutChunk | PutEnd | DescribePath | ReadChunk | Checksum | PrefixDigest | ListFiles
                 | HashFiles | WriteFiles | NativeStacks)
HOST_OPERATIONS: tuple[type, ...] = get_args(HostOperation)


def is_host_operation(op: object) -> TypeGuard[HostOperation]:
    """Whether `op` is one of the host operations an agent carries out."""
    return isinstance(op, HOST_OPERATIONS)
