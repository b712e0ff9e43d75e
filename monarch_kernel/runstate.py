"""The controller's bookkeeping: its loop thread, and what it knows of ranks, hosts and requests.

Everything here is plain state; `controller.MeshRuntime` is what acts on it, on the loop
thread that `ControllerLoop` runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import messages as m
from .errors import RankFailure
from .hosts import HostConnection
from .termtext import LineLog
from .transport import AsyncConnection

RANK_LOG_LINES = 500


class ControllerLoop:
    """The process-wide background event loop that all meshes share."""

    _instance: ControllerLoop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="monarch-controller", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> ControllerLoop:
        """The shared loop, started on first use."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = ControllerLoop()
            return cls._instance

    def run(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the loop; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread soon."""
        self.loop.call_soon_threadsafe(fn, *args)


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
    exit_code: int | None = None
    signal: str | None = None
    log: LineLog = field(default_factory=lambda: LineLog(RANK_LOG_LINES))
    load: Any = None  # the latest RankLoad from its host agent

    @property
    def state(self) -> str:
        """idle, busy, dead, unresponsive or starting."""
        if not self.alive:
            return "dead" if self.pid is not None else "starting"
        if not self.responsive:
            return "unresponsive"
        return "busy" if self.inflight or (self.load is not None and self.load.activity) else "idle"


@dataclass(frozen=True)
class RankSnapshot:
    """A frozen view of a rank's state, safe to hand to other threads."""

    rank: int
    host: str
    local_rank: int
    pid: int | None
    state: str
    busy_for_s: float | None
    exit_code: int | None
    signal: str | None
    busy_with: str | None = None  # the label of what it runs (e.g. "In[3]")
    load: Any = None  # RankLoad: CPU %, RSS, GPU memory and utilization


@dataclass
class Request:
    """One request in flight over some ranks, and what came back so far."""

    req_id: int
    ranks: frozenset[int]
    label: str
    fail_fast: bool
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    results: dict[int, m.Result] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    on_done: Callable[[], None] | None = None

    @property
    def outstanding(self) -> set[int]:
        """Ranks that have neither answered nor failed."""
        return set(self.ranks) - set(self.results) - set(self.failures)


@dataclass(frozen=True)
class TimingRecord:
    """How long one rank took for one request (None: it died or was lost)."""

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
    conn: AsyncConnection | None = None
    started: asyncio.Future | None = None
    store_port: asyncio.Future | None = None
    last_pong: float = 0.0
    answered: bool = False
    log_path: str = ""
