"""The controller: one asyncio loop on a background thread of the kernel.

It owns the connections to host agents, the table of ranks and their states, and the
requests in flight. Everything here runs on the loop thread; callers in the notebook's
thread hand work over with `ControllerLoop.call` and get results through
concurrent futures and per-request event queues, so the notebook's own event loop is
never blocked by mesh traffic. Actor calls go through the mesh's `callrouter.ControllerSender`.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from . import messages as m
from .callrouter import ControllerSender
from .calls import register_sender
from .errors import MeshNotRunningError, MeshStartError, MeshUsageError, RankFailure
from .hosts import HostSpec, open_host
from .runstate import ControllerLoop, HostLink, RankSnapshot, RankState, Request, TimingRecord

HISTORY_RECORDS = 50_000
PING_INTERVAL_S = 1.0
HOST_LOST_AFTER_S = 3.0
HOST_LOST = "HOST_LOST"  # the "signal" of ranks whose host disappeared


class MeshRuntime:
    """Controller-side state of one mesh: its hosts, ranks and requests in flight."""

    _req_ids = itertools.count(1)
    _open: weakref.WeakSet = weakref.WeakSet()  # shut down at interpreter exit

    def __init__(self, name: str, hosts: list[HostSpec], gpus: int, backend: str,
                 env: dict[str, str], start_timeout_s: float = 120.0, master_addr: str | None = None):
        self.name = name
        self.hosts = hosts
        self.gpus = gpus
        self.backend = backend
        self.env = env
        self.master_addr = master_addr
        self._heartbeat: asyncio.Task | None = None
        self.start_timeout_s = start_timeout_s
        self.controller = ControllerLoop.get()
        self.links: list[HostLink] = []
        self.ranks: dict[int, RankState] = {}
        self.requests: dict[int, Request] = {}
        self.run_dir = tempfile.mkdtemp(prefix=f"monarch-{name}-")
        self.shm_dir = _private_shm_dir(name)
        self.closed = False
        self.history: deque[TimingRecord] = deque(maxlen=HISTORY_RECORDS)
        self.idle_output = IdleOutput()  # what ranks print outside cells (actor endpoints)
        self._local_ranks: tuple[list, frozenset[int]] = ([], frozenset())
        self.sender = ControllerSender(self)  # actor calls made from (or routed through) here
        self.actor_meshes: dict[str, tuple[int, ...]] = {}  # spawned actor meshes: name -> ranks
        register_sender(name, self.sender)
        MeshRuntime._open.add(self)

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> None:
        """Start agents and ranks; blocks until every rank is ready or raises MeshStartError."""
        starting = self.controller.run(self._start())
        try:
            starting.result(timeout or self.start_timeout_s + 10)
        except BaseException:
            starting.cancel()  # Ctrl-C or a timeout: stop connecting; shutdown() closes what started
            raise

    async def _start(self) -> None:
        self.links = []
        loop = asyncio.get_running_loop()
        if self._heartbeat is None or self._heartbeat.done():  # each agent is pinged once connected
            self._heartbeat = loop.create_task(self._ping_hosts())
        for index, host in enumerate(self.hosts):
            ranks = list(range(index * self.gpus, (index + 1) * self.gpus))
            link = HostLink(index, host.name, ranks, log_path=os.path.join(self.run_dir, f"agent-{index}.log"),
                            started=_quiet_future(loop))
            self.links.append(link)
            for local, rank in enumerate(ranks):
                self.ranks[rank] = RankState(rank, host.name, local)
        results = await asyncio.gather(*(self._connect(link, spec) for link, spec in zip(self.links, self.hosts)),
                                       return_exceptions=True)
        failed = [(link, exc) for link, exc in zip(self.links, results) if isinstance(exc, BaseException)]
        if failed:
            await self._close_links()  # leave nothing running on the hosts that did start
            report = "\n".join(f"  {link.name}: {_reason(exc)}" for link, exc in failed)
            raise MeshStartError(f"mesh {self.name!r} could not start on {len(failed)} of "
                                 f"{len(self.links)} hosts:\n{report}")
        await self._start_ranks()

    async def _connect(self, link: HostLink, spec: HostSpec) -> None:
        link.host = await open_host(spec, log_path=link.log_path, env=self.env)
        link.last_pong = time.monotonic()
        link.conn = await link.host.connect(
            lambda msg, l=link: self._on_message(l, msg), lambda exc, l=link: self._on_lost(l, exc))

    async def _start_ranks(self) -> None:
        world = len(self.links) * self.gpus
        master = self.master_addr or self.links[0].host.address
        dist = m.DistConfig(self.backend, master, world)
        loop = asyncio.get_running_loop()
        for link in self.links:
            if link.started is None or link.started.done():
                link.started = _quiet_future(loop)  # fails if the agent is lost meanwhile
        port = 0
        if self.backend != "none":
            first = self.links[0]
            first.store_port = loop.create_future()
            first.conn.send(m.BindStore(master))
            await asyncio.wait([first.store_port, first.started], timeout=30,
                               return_when=asyncio.FIRST_COMPLETED)
            if not first.store_port.done():
                if first.started.done():
                    first.started.result()  # raises why the host failed
                raise MeshStartError(f"mesh {self.name!r}: host {first.name} did not bind the rendezvous store")
            port = first.store_port.result()
        for link in self.links:
            specs = tuple(m.RankSpec(r, i, self.gpus) for i, r in enumerate(link.ranks))
            link.conn.send(m.StartRanks(specs, dist, dict(self.env), self.shm_dir if link.host.process else None,
                                        link.index, port))
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(l.started for l in self.links)), self.start_timeout_s)
        except asyncio.TimeoutError:
            raise MeshStartError(
                f"mesh {self.name!r} did not start within {self.start_timeout_s:.0f} s; "
                f"see the agent log in {self.run_dir}") from None
        for batch in infos:
            for info in batch:
                state = self.ranks[info.rank]
                state.pid, state.alive, state.responsive = info.pid, True, True
                state.exit_code = state.signal = None

    def restart(self, timeout: float | None = None) -> None:
        """Replace every rank with a fresh one (same shape); namespaces are lost."""
        self.require_open()
        self.controller.run(self._restart()).result(timeout or self.start_timeout_s + 10)

    async def _restart(self) -> None:
        self._fail_all("the mesh was restarted")
        if any(l.conn is None or l.conn.closed for l in self.links):
            await self._close_links()
            await self._start()
            return
        for state in self.ranks.values():
            state.alive = False
            state.inflight.clear()
        await self._start_ranks()

    def shutdown(self) -> None:
        """Stop every rank and agent and remove temporary files (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.controller.run(self._shutdown()).result(15)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    async def _shutdown(self) -> None:
        self._fail_all(f"mesh {self.name!r} was shut down")
        await self._close_links()
        for state in self.ranks.values():
            state.alive = False

    async def _close_links(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for link in self.links:
            if link.conn is not None and not link.conn.closed:
                link.conn.send(m.Shutdown())
        await asyncio.gather(*(link.host.close() for link in self.links if link.host is not None))
        for link in self.links:
            if link.conn is not None:
                link.conn.close()

    async def _ping_hosts(self) -> None:
        """Ping every agent each second; a host silent for HOST_LOST_AFTER_S is lost."""
        seq = 0
        while not self.closed:
            await asyncio.sleep(PING_INTERVAL_S)
            seq += 1
            now = time.monotonic()
            for link in self.links:
                if link.conn is None or link.conn.closed:
                    continue
                if link.answered and now - link.last_pong > HOST_LOST_AFTER_S:
                    self._on_lost(link, TimeoutError(f"no heartbeat for {now - link.last_pong:.1f} s"))
                    link.conn.close()
                    continue
                link.conn.send(m.Ping(seq))

    def shm_dir_for(self, ranks: Iterable[int]) -> str | None:
        """The shared-memory folder, if every one of these ranks runs on this machine."""
        links, local = self._local_ranks
        if links is not self.links or len(local) == 0:  # hosts were (re)connected
            local = frozenset(r for link in self.links if link.host is not None and link.host.process is not None
                              for r in link.ranks)
            self._local_ranks = (self.links, local)
        return self.shm_dir if local.issuperset(ranks) else None

    def require_open(self) -> None:
        """Raise MeshNotRunningError if the mesh was shut down."""
        if self.closed:
            raise MeshNotRunningError(
                f"mesh {self.name!r} is shut down; start a new one with %mesh up or local_mesh()")

    # ------------------------------------------------------------ requests
    def submit(self, ranks: Iterable[int], make_body: Callable[[int], Any], *, label: str,
               fail_fast: bool = False, on_done: Callable[[], None] | None = None) -> Request:
        """Send a request (body built from its req_id) to ranks; thread-safe."""
        self.require_open()
        req = Request(next(self._req_ids), frozenset(ranks), label, fail_fast, on_done=on_done)
        body = make_body(req.req_id)
        self.controller.call(self._send_request, req, body)
        return req

    def _send_request(self, req: Request, body: Any) -> None:
        self.requests[req.req_id] = req
        now = time.time()
        for rank in sorted(req.ranks):
            state = self.ranks[rank]
            if not state.alive:
                req.failures[rank] = self.death_failure(state, "was already dead")
                continue
            if not state.inflight:
                state.busy_since = now
            state.inflight.append(req.req_id)
        for link in self.links:
            local = tuple(r for r in link.ranks if r in req.ranks and self.ranks[r].alive)
            if local and link.conn is not None and not link.conn.closed:
                link.conn.send(m.ToRanks(local, body))
        self._maybe_complete(req)

    def send_input(self, ranks: Iterable[int], req_id: int, text: str, error: str | None = None) -> None:
        """Answer the input() of these ranks in a request (error: why there is no answer); thread-safe."""
        self.controller.call(self._send_input, frozenset(ranks), req_id, text, error)

    def _send_input(self, ranks: frozenset[int], req_id: int, text: str, error: str | None) -> None:
        for link in self.links:
            local = tuple(r for r in link.ranks if r in ranks)
            if local and link.conn is not None and not link.conn.closed:
                link.conn.send(m.InputReply(local, req_id, text, error))

    def interrupt(self, ranks: Iterable[int] | None = None) -> None:
        """SIGINT the given ranks (default: every busy rank); thread-safe."""
        chosen = None if ranks is None else frozenset(ranks)
        self.controller.call(self._signal, chosen, signal.SIGINT)

    def _signal(self, ranks: frozenset[int] | None, signum: int) -> None:
        for link in self.links:
            local = tuple(r for r in link.ranks
                          if (ranks is None and self.ranks[r].inflight) or (ranks is not None and r in ranks))
            if local and link.conn is not None and not link.conn.closed:
                link.conn.send(m.SignalRanks(local, signum))

    def _maybe_complete(self, req: Request) -> None:
        if req.outstanding or req.future.done():
            return
        self.requests.pop(req.req_id, None)
        for rank in req.ranks:
            state = self.ranks[rank]
            if req.req_id in state.inflight:
                state.inflight.remove(req.req_id)
                state.busy_since = time.time() if state.inflight else None
        self._record_timing(req)
        if req.on_done is not None:
            req.on_done()
        req.events.put(("done", None))
        req.future.set_result(req)

    def _record_timing(self, req: Request) -> None:
        now = time.time()
        for rank in sorted(req.ranks):
            result = req.results.get(rank)
            host = self.ranks[rank].host
            if result is not None:
                self.history.append(TimingRecord(req.label, rank, host, result.finished - result.started,
                                                 result.failure is None, result.finished))
            else:
                self.history.append(TimingRecord(req.label, rank, host, None, False, now))

    def _fail_all(self, why: str) -> None:
        self.sender.fail_all(why)
        self.actor_meshes.clear()  # the ranks that held them are gone
        for req in list(self.requests.values()):
            for rank in req.outstanding:
                state = self.ranks[rank]
                req.failures[rank] = RankFailure(rank, state.host, "lost", "MeshRestarted", why)
            self._maybe_complete(req)

    # ------------------------------------------------------------ messages from agents
    def _on_message(self, link: HostLink, msg: Any) -> None:
        link.last_pong = time.monotonic()
        link.answered = True  # until then the agent may still be importing torch
        if isinstance(msg, m.Output):
            self._route(msg.rank, msg.req_id, ("output", msg.rank, msg.stream, msg.text))
            self.ranks[msg.rank].log.write(msg.stream, msg.text)
        elif isinstance(msg, m.Gathered):
            req = self.requests.get(msg.req_id)
            if req is not None:
                for result in msg.results:
                    req.results[result.rank] = result
                if req.outstanding:  # when all are done, "done" says it (one wake-up, not two)
                    req.events.put(("ranks_done", tuple(r.rank for r in msg.results)))
                self._maybe_complete(req)
        elif isinstance(msg, m.Display):
            self._route(msg.rank, msg.req_id, ("display", msg.rank, msg.data, msg.metadata))
        elif isinstance(msg, m.InputRequest):
            req = self.requests.get(msg.req_id)
            if req is None:
                link.conn.send(m.InputReply((msg.rank,), msg.req_id, "", "its cell is no longer waiting"))
            else:
                req.events.put(("input", msg.rank, msg.prompt, msg.password))
        elif isinstance(msg, m.RankExited):
            self._on_rank_exit(msg)
        elif isinstance(msg, m.RankHealth):
            self._on_health(msg)
        elif isinstance(msg, m.RanksStarted):
            if link.started is not None and not link.started.done():
                link.started.set_result(msg.ranks)
        elif isinstance(msg, m.ActorReply):
            self.sender.routed_reply(msg)
        elif isinstance(msg, m.ActorCall):
            self.sender.route_call(msg)
        elif isinstance(msg, m.CancelCall):
            self.sender.route_cancel(msg)
        elif isinstance(msg, m.HostLoad):
            for load in msg.loads:
                state = self.ranks.get(load.rank)
                if state is not None:
                    state.load = load
        elif isinstance(msg, m.Pong):
            link.last_pong = time.monotonic()
        elif isinstance(msg, m.StoreBound):
            if link.store_port is not None and not link.store_port.done():
                link.store_port.set_result(msg.port)
        elif isinstance(msg, m.RanksFailed):
            if link.started is not None and not link.started.done():
                link.started.set_exception(MeshStartError(
                    f"mesh {self.name!r}: ranks on host {link.name} failed to start:\n{msg.text}"))

    def _route(self, rank: int, req_id: int | None, event: tuple) -> None:
        state = self.ranks[rank]
        if req_id is None and state.inflight:
            req_id = state.inflight[0]  # fd-level output belongs to what the rank is running
        req = self.requests.get(req_id) if req_id is not None else None
        if req is not None:
            req.events.put(event)
        elif event[0] == "output":
            self.idle_output.write(rank, event[2], event[3])

    def death_failure(self, state: RankState, how: str) -> RankFailure:
        """The failure of work on a dead rank: pid, exit code or signal, stderr tail, what to do."""
        if state.signal == HOST_LOST:
            status = f"its host {state.host} was lost"
        else:
            status = f"killed by {state.signal}" if state.signal else f"exit code {state.exit_code}"
        tail = tuple(text for stream, text in state.log if stream == "stderr")[-10:]
        return RankFailure(
            state.rank, state.host, "died", "RankDied",
            f"rank {state.rank} (host {state.host}, pid {state.pid}) {how}: {status}. "
            f"Run %mesh restart (or mesh.restart()) for a fresh mesh.",
            pid=state.pid, exit_code=state.exit_code, signal=state.signal, stderr_tail=tail,
        )

    def _on_rank_exit(self, msg: m.RankExited, *, interrupt_others: bool = False) -> None:
        state = self.ranks[msg.rank]
        state.alive = False
        state.exit_code, state.signal = msg.exit_code, msg.signal
        for line in msg.stderr_tail:
            if ("stderr", line) not in state.log:
                state.log.append(("stderr", line))
        if msg.expected:
            return
        failure = self.death_failure(state, "died")
        self.sender.rank_died(msg.rank, failure.message)
        failure = RankFailure(**{**failure.__dict__, "stderr_tail": msg.stderr_tail or failure.stderr_tail})
        for req_id in list(state.inflight):
            req = self.requests.get(req_id)
            if req is None or msg.rank in req.results:
                continue
            req.failures[msg.rank] = failure
            req.events.put(("notice", msg.rank, failure.message))
            if req.fail_fast or interrupt_others:
                self._signal(frozenset(req.outstanding), signal.SIGINT)
            self._maybe_complete(req)
        state.inflight.clear()

    def _on_health(self, msg: m.RankHealth) -> None:
        state = self.ranks[msg.rank]
        state.responsive = msg.responsive
        if not msg.responsive:
            note = (f"rank {msg.rank} (host {state.host}, pid {state.pid}) is not answering heartbeats; "
                    "it may be stopped (SIGSTOP) or stuck in native code")
            for req_id in state.inflight:
                req = self.requests.get(req_id)
                if req is not None:
                    req.events.put(("notice", msg.rank, note))

    def _on_lost(self, link: HostLink, exc: Exception | None) -> None:
        if self.closed:
            return
        why = f"lost the connection to host {link.name}" + (f" ({exc})" if exc else "")
        for rank in link.ranks:
            state = self.ranks[rank]
            if state.alive:
                # a lost host would leave the others waiting in collectives: end its cells
                self._on_rank_exit(m.RankExited(rank, state.pid or 0, None, HOST_LOST, (why,), False),
                                   interrupt_others=True)
        if link.started is not None and not link.started.done():
            asyncio.get_running_loop().create_task(self._fail_start(link))

    async def _fail_start(self, link: HostLink) -> None:
        why = await link.host.explain_exit(link.log_path) if link.host is not None else "its agent exited"
        if link.started is not None and not link.started.done():
            link.started.set_exception(MeshStartError(f"mesh {self.name!r}: host {link.name}: {why}"))

    # ------------------------------------------------------------ inspection
    def snapshot(self) -> list[RankSnapshot]:
        """Frozen states of all ranks (thread-safe enough: reads simple fields)."""
        now = time.time()
        return [
            RankSnapshot(s.rank, s.host, s.local_rank, s.pid, s.state,
                         (now - s.busy_since) if s.busy_since and s.inflight else None,
                         s.exit_code, s.signal,
                         self._label_of(s.inflight) or (s.load.activity if s.load is not None else None) or None,
                         s.load if s.alive else None)
            for s in sorted(self.ranks.values(), key=lambda s: s.rank)
        ]

    def _label_of(self, inflight: list[int]) -> str | None:
        for req_id in list(inflight):
            req = self.requests.get(req_id)
            if req is not None:
                return req.label
        return None

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

    def logs(self, rank: int, lines: int = 50) -> list[tuple[str, str]]:
        """The last lines a rank printed (stream, text)."""
        return self.ranks[rank].log.tail(lines)



class IdleOutput:
    """Text ranks print outside any cell (actor endpoints, their threads), shown as it comes.

    Whole lines go to this process's stdout/stderr, tagged with the rank; in a notebook
    they appear in the cell that is running (or the last one that ran).
    """

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        """Show the complete lines of `text`; keep a trailing partial line for later."""
        text = self._partial.pop((rank, stream), "") + text
        *lines, rest = text.split("\n")
        if rest:
            self._partial[(rank, stream)] = rest
        if lines:
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            out.flush()


@atexit.register
def _shutdown_open_meshes() -> None:
    """Meshes the user never shut down: stop their processes and remove their files."""
    for runtime in list(MeshRuntime._open):
        try:
            runtime.shutdown()
        except Exception:  # noqa: BLE001 - best effort while the interpreter exits
            pass


def _quiet_future(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """A future whose failure may go unawaited (a host failing while the start is aborted)."""
    future = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("host ") and ": " in text else (text or type(exc).__name__)


def _private_shm_dir(name: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix=f"monarch-{name}-", dir=base)
    os.chmod(path, 0o700)
    return path
