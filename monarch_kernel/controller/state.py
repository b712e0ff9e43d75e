"""What the controller knows of one mesh: its host links, ranks, requests and history.

`MeshState` is shared by the runtime (lifecycle, requests) and the call router; it is
read and changed on the controller's loop thread only, except where a method says so.
Its `by_link` helper is the one place that fans out to ranks, host by host, over the
links that are open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from monarch_kernel.controller.events import RequestEvent
from monarch_kernel.controller.hosts import HostSpec
from monarch_kernel.core.errors import ConnectionClosed, MeshNotRunningError, MeshUsageError
from monarch_kernel.core.failures import FailureKind, RankFailure, exit_text
from monarch_kernel.core.folders import owned_folder, private_shm_dir, sweep_stale_folders
from monarch_kernel.core.status import RankStatus
from monarch_kernel.core.termtext import LineLog
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.wire import messages as m

if TYPE_CHECKING:
    from monarch_kernel.controller.hosts import Connection, HostConnection

RANK_LOG_LINES = 500
RELAY_BRANCHING = 16  # the default: hosts the controller (and each relay) sends a broadcast to itself
HISTORY_RECORDS = 50_000


class Allocation(Protocol):
    """A batch scheduler's allocation that a mesh runs in (a Slurm job)."""

    def release(self) -> None:
        """After down: end the allocation if the mesh made it (and was not asked to keep it)."""

    def status_line(self, max_age_s: float = 0.0) -> str:
        """One line for status: job, state, time left (and a warning when little is left).

        Views that redraw often pass max_age_s: a line that recent is reused, not asked for again.
        """

    def renew(self) -> tuple[HostSpec, ...]:
        """The hosts to start again on at a restart (the same, or those of a new allocation)."""

    def abandon(self) -> None:
        """A restart was interrupted or timed out: give up a renewal still waiting (cancelling its job)."""


@dataclass(frozen=True)
class MeshSpec:
    """What a mesh is: its name, hosts, ranks per host, backend, environment and timings."""

    name: str
    hosts: tuple[HostSpec, ...]
    gpus: int  # ranks per host
    backend: str  # torch.distributed backend: gloo, nccl or none
    env: dict[str, str] = field(default_factory=dict, hash=False)
    master_addr: str | None = None  # host 0's address as the other hosts reach it (default: as we reach it)
    start_timeout_s: float = 120.0
    health: m.HealthTimings = m.HealthTimings()
    preload: tuple[str, ...] = ("torch",)  # imported by each agent before it forks ranks
    persist_s: float | None = None  # it outlives its kernel this long without one (None: it dies with it)
    relay_branching: int = RELAY_BRANCHING  # past this many hosts, agents relay the controller's broadcasts
    # each rank's CPU and NUMA pinning, by local rank (spawn_procs' proc_bind; empty: none)
    proc_bind: tuple[tuple[tuple[str, str], ...], ...] = ()
    # each rank's own environment variables, by global rank (spawn_procs' bootstrap_command; empty: none)
    rank_env: tuple[tuple[tuple[str, str], ...], ...] = ()
    allocation: Allocation | None = field(default=None, compare=False)  # a scheduler's job the mesh runs in


@dataclass
class RankState:
    """What the controller knows about one rank (mutable, loop thread only)."""

    rank: int
    host: str
    local_rank: int
    pid: int | None = None
    alive: bool = False
    responsive: bool = True
    inflight: list[int] = field(default_factory=list)
    busy_since: float | None = None
    fd_seen: int = 0  # bytes of its fd output the agent passed on that reached us (wire/fd_marks.py)
    exit_code: int | None = None
    signal: str | None = None
    host_lost: bool = False  # it died with its host (no exit status)
    cause: str = ""  # what else is known of the death (a scheduler's word: "Slurm job 12 is TIMEOUT")
    log: LineLog = field(default_factory=lambda: LineLog(RANK_LOG_LINES))
    load: Any = None  # the latest RankLoad from its host agent
    paused_in_debugger: bool = False  # a thread of it stopped at a breakpoint of the notebook's debugger

    @property
    def state(self) -> RankStatus:
        """Idle, busy, dead, unresponsive or starting."""
        if not self.alive:
            return RankStatus.DEAD if self.pid is not None else RankStatus.STARTING
        if not self.responsive:
            return RankStatus.UNRESPONSIVE
        busy = self.inflight or (self.load is not None and self.load.activity)
        return RankStatus.BUSY if busy else RankStatus.IDLE

    def exit_text(self) -> str:
        """How it ended: "killed by SIGKILL", "exit code 3", or "its host h was lost" (and why, if known)."""
        how = f"its host {self.host} was lost" if self.host_lost else exit_text(self.exit_code, self.signal)
        return f"{how} ({self.cause})" if self.cause else how

    def started(self, pid: int) -> None:
        """A fresh process now serves this rank."""
        self.pid, self.alive, self.responsive = pid, True, True
        self.exit_code = self.signal = None
        self.cause = ""
        self.host_lost = False


@dataclass(frozen=True)
class RankSnapshot:
    """A frozen view of a rank's state, safe to hand to other threads."""

    rank: int
    host: str
    local_rank: int
    pid: int | None
    state: RankStatus
    busy_for_s: float | None
    exit_code: int | None
    signal: str | None
    busy_with: str | None = None  # the label of what it runs (e.g. "In[3]")
    load: Any = None  # RankLoad: CPU %, RSS, GPU memory and utilization
    exit_text: str = ""  # for dead ranks: how it ended
    collective: str = ""  # the collective it waits in ("in all_reduce #58 (default group) for 31s"), if any


@dataclass
class Request:
    """One request in flight over some ranks, and what came back so far."""

    req_id: int
    ranks: frozenset[int]
    label: str
    fail_fast: bool
    events: queue.SimpleQueue[RequestEvent] = field(default_factory=queue.SimpleQueue)
    results: dict[int, m.Result] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    on_done: Callable[[], None] | None = None
    done: bool = False  # every rank answered or failed (see finish)
    stopping: bool = False  # its ranks were told to stop it (fail fast, a lost host, a cancel, an interrupt)
    on_lanes: bool = False  # sent on the direct lanes: its output and results come back on them
    fd_shown: dict[int, int] = field(default_factory=dict)  # characters of fd output shown, by rank
    fd_dropped: dict[int, int] = field(default_factory=dict)  # and past the cap (see core/output_caps)
    held: dict[int, tuple[m.Result, float]] = field(default_factory=dict)  # results waiting for fd output
    timings: list[RankTiming] = field(default_factory=list)  # each rank's part, once every rank answered
    aborted: dict[int, str] = field(default_factory=dict)  # ranks where a stop ended collectives: what was done
    _inputs: dict[int, bool] = field(default_factory=dict)  # id(InputRequest) -> claimed (True) or expired
    _regrouped: threading.Event | None = None  # set once the group is made anew after its stop (see claim_regroup)
    _completion: concurrent.futures.Future[Request] | None = None  # made when someone awaits it
    _lock: threading.Lock = field(default_factory=threading.Lock)  # guards _inputs, done and _completion

    def claim_input(self, msg: m.InputRequest) -> bool:
        """A waiting thread takes this input() to ask the notebook (False: it expired already)."""
        with self._lock:
            return self._inputs.setdefault(id(msg), True)

    def expire_input(self, msg: m.InputRequest) -> bool:
        """Nobody took this input() in time: True if it is now expired (False: it was claimed)."""
        with self._lock:
            return not self._inputs.setdefault(id(msg), False)

    def claim_regroup(self) -> tuple[bool, threading.Event]:
        """(True, event) for the one caller that makes the group anew after this request's stop, which sets
        the event when done; (False, event) for the others, who wait on it (the waiting future, %mesh interrupt)."""
        with self._lock:
            if self._regrouped is None:
                self._regrouped = threading.Event()
                return True, self._regrouped
            return False, self._regrouped

    def finish(self) -> None:
        """Mark the request done, and resolve its completion future if one was made (a second call does nothing)."""
        with self._lock:
            if self.done:
                return
            self.done = True
            completion = self._completion
        if completion is not None:
            completion.set_result(self)

    def completion(self) -> concurrent.futures.Future[Request]:
        """A future resolved when the request is done (made on first use: few requests are awaited)."""
        with self._lock:
            if self._completion is None:
                self._completion = concurrent.futures.Future()
                if self.done:
                    self._completion.set_result(self)
            return self._completion

    @property
    def outstanding(self) -> set[int]:
        """Ranks that have neither answered nor failed."""
        return set(self.ranks) - set(self.results) - set(self.failures)


class TimingRecord(NamedTuple):
    """How long one rank took for one request (None: it died or was lost); a tuple, made
    for every rank of every request."""

    label: str
    rank: int
    host: str
    seconds: float | None
    ok: bool
    finished_at: float


@dataclass
class HostLink:
    """The controller's end of one host agent."""

    index: int
    name: str
    ranks: list[int]
    host: HostConnection | None = None
    conn: Connection | None = None
    greeted: asyncio.Future[None] | None = None  # the agent said which version it runs
    explained: bool = False  # its loss is being (or was) reported with what the scheduler says (Slurm)
    started: asyncio.Future[tuple[m.RankInfo, ...]] | None = None
    store_port: asyncio.Future[int] | None = None
    last_pong: float = 0.0
    answered: bool = False
    last_bytes: float | None = None  # the connection's last_received at the previous ping tick
    last_backlog: int = 0  # bytes queued for the agent at the previous ping tick
    log_path: str = ""
    unreachable: bool = False  # silent for host_unreachable_after_s (not yet lost)

    @property
    def is_open(self) -> bool:
        """Whether messages can be sent to the agent."""
        return self.conn is not None and not self.conn.closed

    def close(self) -> None:
        """Close the connection to the agent (it exits when its input ends)."""
        if self.conn is not None:
            self.conn.close()

    def send(self, msg: Any) -> bool:
        """Send if the link is open; False if it is not (or closed as we sent: its loss is reported apart)."""
        if self.conn is None or self.conn.closed:
            return False
        try:
            self.conn.send(msg)
        except ConnectionClosed:
            return False
        return True


class MeshState:
    """The ranks, host links, requests and timing history of one mesh."""

    def __init__(self, name: str, folders: tuple[str, str] | None = None) -> None:
        """folders: (run_dir, shm_dir) of a mesh that outlived its kernel (else new ones are made)."""
        self.name = name
        self.links: list[HostLink] = []
        self.ranks: dict[int, RankState] = {}
        self.requests: dict[int, Request] = {}
        self.history: deque[TimingRecord] = deque(maxlen=HISTORY_RECORDS)
        self.closed = False
        self.closed_why = ""  # why it is closed, when not by %mesh down (taken over, left for the next kernel)
        self.persistent = False  # it outlives its kernel: a lost host may still hold its state (no restart advice)
        sweep_stale_folders()
        if folders is not None:
            self.run_dir, self.shm_dir = folders
        else:
            self.run_dir = owned_folder(tempfile.mkdtemp(prefix=f"monarch-{name}-"))
            self.shm_dir = owned_folder(private_shm_dir(name))
        self._local_ranks: tuple[list[HostLink], frozenset[int]] = ([], frozenset())
        # sends work down the relay tree while there is one (controller/relays.py): (links, by_link, body)
        self.relay_route: Callable[[list[HostLink], Iterable[tuple[HostLink, tuple[int, ...]]], Any], None] | None = None

    def by_link(self, ranks: Iterable[int] | None) -> Iterator[tuple[HostLink, tuple[int, ...]]]:
        """(link, its ranks among `ranks`) for each open link holding some (None: all ranks)."""
        chosen = None if ranks is None else frozenset(ranks)
        for link in self.links:
            if not link.is_open:
                continue
            local = tuple(link.ranks) if chosen is None else tuple(r for r in link.ranks if r in chosen)
            if local:
                yield link, local

    def send_work(self, ranks: Iterable[int], body: Any) -> None:
        """ToRanks(ranks, body) to the hosts holding them: through the relay tree while there is one."""
        if self.relay_route is not None:
            self.relay_route(self.links, self.by_link(ranks), body)
        else:
            self.send_to_ranks(ranks, lambda local: m.ToRanks(local, body))

    def send_to_ranks(self, ranks: Iterable[int] | None, make: Callable[[tuple[int, ...]], Any]) -> None:
        """Send make(local ranks) to the agent of each host holding some of `ranks`."""
        for link, local in self.by_link(ranks):
            link.send(make(local))

    def link_of(self, rank: int) -> HostLink | None:
        """The link of the host a rank runs on."""
        for link in self.links:
            if rank in link.ranks:
                return link
        return None

    def host_of(self, rank: int) -> str:
        """The host a rank runs on ("" if unknown)."""
        state = self.ranks.get(rank)
        return state.host if state is not None else ""

    def is_alive(self, rank: int) -> bool:
        """Whether a rank is running (as last reported)."""
        state = self.ranks.get(rank)
        return state is not None and state.alive

    def shm_dir_for(self, ranks: Iterable[int]) -> str | None:
        """The shared-memory folder, if every one of these ranks runs on this machine (any thread)."""
        links, local = self._local_ranks
        if links is not self.links or len(local) == 0:  # hosts were (re)connected
            local = frozenset(r for link in self.links if link.host is not None and link.host.is_local
                              for r in link.ranks)
            self._local_ranks = (self.links, local)
        return self.shm_dir if local.issuperset(ranks) else None

    def agent_log(self, host: int | str, lines: int = 50) -> str:
        """The last lines of the log of a host agent, by host index or name."""
        for link in self.links:
            if host in (link.index, link.name):
                try:
                    with open(link.log_path, encoding="utf-8", errors="replace") as f:
                        return "".join(f.readlines()[-lines:])
                except OSError:
                    return ""
        names = ", ".join(link.name for link in self.links)
        raise MeshUsageError(f"mesh {self.name!r} has no host {host!r} (hosts: {names})")

    def require_open(self) -> None:
        """Raise MeshNotRunningError if the mesh was shut down."""
        if self.closed:
            raise MeshNotRunningError(self.closed_why or
                                      f"mesh {self.name!r} is shut down; start a new one with %mesh up or local_mesh()")

    def death_failure(self, state: RankState, how: str) -> RankFailure:
        """The failure of work on a dead rank: pid, exit code or signal, stderr tail, what to do."""
        tail = tuple(text for stream, text in state.log if stream == "stderr")[-10:]
        if state.host_lost:  # it may still run over there (a cut cable): say what we know, not more
            how = "is out of reach" if how == "died" else how
        advice = "Run %mesh restart (or mesh.restart()) for a fresh mesh."
        if state.host_lost and self.persistent:  # a restart would stop what the mesh kept there
            advice = (f"Mesh {self.name!r} is persistent and may still run there with its state: when the host is "
                      f"back, attach it again with %mesh attach {self.name} --take (monarch_kernel.attach("
                      f"{self.name!r}, take=True)); %mesh restart would stop what it holds.")
        return RankFailure(
            state.rank, state.host, FailureKind.DIED, "RankDied",
            f"rank {state.rank} (host {state.host}, pid {state.pid}) {how}: {state.exit_text()}. {advice}",
            pid=state.pid, exit_code=state.exit_code, signal=state.signal, stderr_tail=tail,
        )

    def record_timing(self, label: str, times: Iterable[RankTiming],
                      finished_at: float | None = None) -> None:
        """Keep per-rank durations (None: it died) of a request or call in the history (any thread)."""
        now = time.time() if finished_at is None else finished_at
        for rank, seconds, ok in times:
            self.history.append(TimingRecord(label, rank, self.host_of(rank), seconds, ok, now))

    def snapshot(self) -> list[RankSnapshot]:
        """Frozen states of all ranks (any thread: copies of fields the loop replaces whole)."""
        now = time.time()
        out = []
        for s in sorted(list(self.ranks.values()), key=lambda s: s.rank):
            inflight = list(s.inflight)
            busy_with = self._label_of(inflight) or (s.load.activity if s.load is not None else None) or None
            if s.paused_in_debugger and s.alive:
                busy_with = f"{busy_with or 'its code'}: paused in the debugger"
            out.append(RankSnapshot(
                s.rank, s.host, s.local_rank, s.pid, s.state,
                (now - s.busy_since) if s.busy_since and inflight else None,
                s.exit_code, s.signal, busy_with, s.load if s.alive else None,
                s.exit_text() if not s.alive and s.pid is not None else "",
                s.load.collective if s.load is not None and s.alive and inflight else ""))
        return out

    def _label_of(self, inflight: list[int]) -> str | None:
        for req_id in inflight:
            req = self.requests.get(req_id)
            if req is not None:
                return req.label
        return None


