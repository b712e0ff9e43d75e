"""MeshRuntime: the life of one mesh on the controller's loop: start, watch, restart, shut down. It
connects to each host's agent, starts the ranks, pings the agents, and dispatches what they send (by
type) to the request book, the call router or itself; the notebook's thread hands it work."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import sys
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ClassVar

from monarch_kernel.controller import proc_requests
from monarch_kernel.controller.debugging import RankDebugging
from monarch_kernel.controller.heartbeat import HostHearing
from monarch_kernel.controller.host_ops import HostOps
from monarch_kernel.controller.hosts import HostConnection, HostSpec, open_host
from monarch_kernel.controller.inspections import Inspections
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.rank_start import quiet_future, start_failure, start_ranks
from monarch_kernel.controller.relays import ControllerRelays
from monarch_kernel.controller.requests import DiscardedOutput, IdleOutput, RequestBook
from monarch_kernel.controller.router import ControllerSender
from monarch_kernel.controller.state import HostLink, MeshSpec, MeshState, RankSnapshot, RankState
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.folders import release_folder
from monarch_kernel.core.timing import TimingReporter
from monarch_kernel.core.versions import __version__
from monarch_kernel.wire import handshake
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import relay_messages as rm
from monarch_kernel.wire.calls import register_sender, unregister_sender
from monarch_kernel.wire.debugging import DebugFromRank
from monarch_kernel.wire.diagnosis import CollectivesAborted, RankInspection
from monarch_kernel.wire.serialization import carries_shm_refs, forget_mappings
from monarch_kernel.wire.transport import FrameError

Handler = Callable[[HostLink, Any], None]
HostOpener = Callable[..., Awaitable[HostConnection]]  # (spec, *, log_path, env, mesh_folders) -> a started agent


class MeshRuntime:
    """Controller-side life of one mesh: its hosts, ranks and requests in flight."""

    _open: ClassVar[weakref.WeakSet[MeshRuntime]] = weakref.WeakSet()  # shut down at interpreter exit

    def __init__(self, spec: MeshSpec, *, idle_output: IdleOutput | None = None,
                 report_timing: TimingReporter | None = None, opener: HostOpener = open_host,
                 clock: Callable[[], float] = time.monotonic, folders: tuple[str, str] | None = None):
        self.spec = spec
        self._open_host = opener  # how a host's agent is started (tests give an in-memory one)
        self._clock = clock  # what "now" is when judging a host's silence
        self.controller = ControllerLoop.get()
        self.state = MeshState(spec.name, folders)  # (folders: those of a mesh that outlived its kernel)
        self.sender = ControllerSender(self.state, self.controller, report_timing)  # actor calls
        self.idle_output = idle_output or DiscardedOutput()  # ranks' text outside requests (the notebook's view)
        self.requests = RequestBook(self.state, self.controller, self.sender, self.idle_output)
        self.relays = ControllerRelays(spec.relay_branching, _notice)  # fan-out through agents, past branching hosts
        self._heartbeat: asyncio.Task[None] | None = None
        self.hearing = HostHearing(self.state, spec, clock, self._on_lost, _notice)  # pings, silences
        self.host_ops = HostOps()  # work for the agents themselves (workspace files)
        self.inspections = Inspections(self.state, self.controller)  # where ranks are (hangs)
        self.debugging = RankDebugging(self.state, self.controller)  # JupyterLab's debugger in a rank
        self._lifecycle = asyncio.Lock()  # one restart or shutdown at a time (a double click, two cells)
        self._handlers: dict[type, Handler] = {
            m.Output: lambda link, msg: self.requests.output(msg),
            m.Gathered: lambda link, msg: self.requests.gathered(msg),
            m.Display: lambda link, msg: self.requests.display(msg),
            m.InputRequest: lambda link, msg: self.requests.input_request(link.send, msg),
            m.RankExited: self._on_rank_exited,
            m.RankHealth: lambda link, msg: self.requests.health(msg),
            m.ActorReply: lambda link, msg: self.sender.reply_from_agents(msg),
            m.ActorCall: lambda link, msg: self.sender.call_from_agents(msg),
            m.CancelCall: lambda link, msg: self.sender.cancel_from_agents(msg),
            m.OwnActors: lambda link, msg: self.sender.own_actors(msg),
            m.BroadcastFailed: lambda link, msg: self.sender.supervisors.broadcast_failed(msg),
            m.ActorFailed: lambda link, msg: self.sender.actor_failed(msg),
            m.ProcsRequest: lambda link, msg: proc_requests.handle(self.spec, link.index, self.sender.router, msg),
            m.ListeningForCalls: lambda link, msg: self.sender.far.listening(msg),
            rm.RelayUp: self._on_relayed,
            rm.RelayListening: self.relays.listening,
            rm.RelayJoined: self.relays.joined,
            rm.RelayLost: lambda link, msg: self._relay_lost(msg.host, msg.why),
            m.HostLoad: self._on_load,
            m.Pong: lambda link, msg: None,  # any message counts as a sign of life
            m.AgentProblem: lambda link, msg: print(f"monarch_kernel: host {link.name}: {msg.text}", file=sys.stderr),
            m.RanksStarted: lambda link, msg: settle(link.started, msg.ranks),
            m.StoreBound: lambda link, msg: settle(link.store_port, msg.port),
            m.RanksFailed: self._on_ranks_failed,
            m.HostOpDone: lambda link, msg: self.host_ops.done(link, msg),
            RankInspection: lambda link, msg: self.inspections.answer(msg),
            DebugFromRank: lambda link, msg: self.debugging.arrived(msg),
            CollectivesAborted: lambda link, msg: self.requests.collectives_aborted(msg),
        }
        register_sender(spec.name, self.sender)
        MeshRuntime._open.add(self)

    # ------------------------------------------------------------ views of the state
    @property
    def name(self) -> str:
        """The mesh's name."""
        return self.spec.name

    @property
    def closed(self) -> bool:
        """Whether the mesh was shut down (or left for the next kernel, or taken over by another)."""
        return self.state.closed

    @property
    def ranks(self) -> dict[int, RankState]:
        """Every rank's state, by global rank."""
        return self.state.ranks

    @property
    def links(self) -> list[HostLink]:
        """The links to the host agents, in host order."""
        return self.state.links

    def snapshot(self) -> list[RankSnapshot]:
        """Frozen states of all ranks."""
        return self.state.snapshot()

    def bytes_sent(self) -> dict[str, int]:
        """Bytes the controller has sent each host's agent so far, by host name."""
        return {link.name: link.conn.bytes_sent if link.conn is not None else 0 for link in self.state.links}

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> None:
        """Start agents and ranks; blocks until every rank is ready or raises MeshStartError."""
        starting = self.controller.run(self._start())
        try:
            starting.result(timeout or self.spec.start_timeout_s + 10)
        except BaseException:
            starting.cancel()  # Ctrl-C or a timeout: stop connecting; shutdown() closes what started
            raise

    async def _start(self) -> None:
        state = self.state
        state.links = []
        loop = asyncio.get_running_loop()
        if self._heartbeat is None or self._heartbeat.done():  # each agent is pinged once connected
            self._heartbeat = loop.create_task(self.hearing.ping_hosts())
        for index, host in enumerate(self.spec.hosts):
            ranks = list(range(index * self.spec.gpus, (index + 1) * self.spec.gpus))
            link = HostLink(index, host.name, ranks, log_path=os.path.join(state.run_dir, f"agent-{index}.log"),
                            started=quiet_future(loop))
            state.links.append(link)
            for local, rank in enumerate(ranks):
                state.ranks[rank] = RankState(rank, host.name, local)
        results = await asyncio.gather(*(self._connect(link, spec) for link, spec in zip(state.links, self.spec.hosts)),
                                       return_exceptions=True)
        failed = [(link, exc) for link, exc in zip(state.links, results) if isinstance(exc, BaseException)]
        if failed:
            await self._close_links()  # leave nothing running on the hosts that did start
            report = "\n".join(f"  {link.name}: {start_failure(exc)}" for link, exc in failed)
            raise MeshStartError(f"mesh {self.name!r} could not start on {len(failed)} of "
                                 f"{len(state.links)} hosts:\n{report}")
        await start_ranks(self.state, self.spec, self.relays)

    async def _connect(self, link: HostLink, spec: HostSpec) -> None:
        link.greeted = quiet_future(asyncio.get_running_loop())
        host = link.host = await self._open_host(spec, log_path=link.log_path, env=self.spec.env,
                                                 mesh_folders=(self.state.run_dir, self.state.shm_dir),
                                                 persist=self.spec.persist_s is not None)
        link.last_pong = self._clock()
        link.conn = await host.connect(partial(self._on_message, link), partial(self._on_lost, link))

    def restart(self, timeout: float | None = None) -> None:
        """Replace every rank with a fresh one (same shape); namespaces are lost."""
        self.state.require_open()
        restarting = self.controller.run(self._restart())
        try:
            restarting.result(timeout or self.spec.start_timeout_s + 10)
        except BaseException:
            # Ctrl-C or a timeout: a renewal still waiting for the scheduler is given up (its job cancelled); ranks
            # already starting finish starting, so that the mesh is whole again (not half started)
            if self.spec.allocation is not None:
                self.spec.allocation.abandon()
            raise

    async def _restart(self) -> None:
        async with self._lifecycle:
            if not self.state.closed:
                await self._restart_now()

    async def _restart_now(self) -> None:
        self.requests.fail_all("the mesh was restarted")
        renewed = self.spec.hosts
        if self.spec.allocation is not None:  # the job may have ended: ask the scheduler again
            renewed = await asyncio.to_thread(self.spec.allocation.renew)
            if self.state.closed:  # the mesh went down while the scheduler was asked
                return
        moved = [(h.name, h.options) for h in renewed] != [(h.name, h.options) for h in self.spec.hosts]
        if moved or any(not link.is_open for link in self.state.links):
            await self._close_links()
            self.spec = dataclasses.replace(self.spec, hosts=renewed)
            await self._start()
            return
        for rank_state in self.state.ranks.values():
            rank_state.alive = False
            rank_state.inflight.clear()
            rank_state.fd_seen = 0  # the fresh ranks' fd output is counted from 0 (wire/fd_marks.py)
        await start_ranks(self.state, self.spec, self.relays)

    def leave(self) -> None:
        """What the kernel's end does to the mesh: shut it down (a persistent mesh waits for the next kernel)."""
        self.shutdown()

    def shutdown(self) -> None:
        """Stop every rank and agent and remove temporary files (idempotent)."""
        if self.state.closed:
            return
        self.state.closed = True
        unregister_sender(self.name, self.sender)
        try:
            self.controller.run(self._shutdown()).result(15)
        finally:
            with contextlib.suppress(Exception):  # (lines held in an aggregation window are shown, not lost; at the
                self.idle_output.flush()          # interpreter's exit stdout may be closed: the clean-up goes on)
            release_folder(self.state.run_dir)
            release_folder(self.state.shm_dir)
            forget_mappings(self.state.shm_dir)  # what this process kept mapped of it goes too
            if self.spec.allocation is not None:
                self.spec.allocation.release()

    async def _shutdown(self) -> None:
        async with self._lifecycle:
            self.requests.fail_all(f"mesh {self.name!r} was shut down")
            await self._close_links()
        for rank_state in self.state.ranks.values():
            rank_state.alive = False

    async def _close_links(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self.relays.stop()
        self.state.relay_route = None
        links = self.state.links
        for link in links:
            self.host_ops.lost(link, "the mesh went down or restarted")
            link.send(m.Shutdown())
        await asyncio.gather(*(link.host.close() for link in links if link.host is not None))
        for link in links:
            link.close()

    # ------------------------------------------------------------ messages from agents
    def _on_message(self, link: HostLink, msg: Any) -> None:
        link.last_pong = self._clock()
        if link.unreachable:
            self.hearing.note_reachability(link, 0.0)
        if not link.answered:  # the agent's first frame says which version it runs
            link.answered = True
            problem = handshake.mismatch(msg, link.name, __version__)
            if problem is None and self.spec.preload:  # it imports them while the other hosts connect
                link.send(m.Preload(self.spec.preload))
            if link.greeted is not None and not link.greeted.done():
                if problem is None:
                    link.greeted.set_result(None)
                else:
                    link.greeted.set_exception(MeshStartError(f"mesh {self.name!r}: {problem}"))
            if problem is not None:
                link.close()
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            return
        if link.host is not None and link.host.remote is not None and carries_shm_refs(msg):
            self._on_lost(link, FrameError("it named a shared-memory file here, which only local processes may"))
            link.close()
            return
        try:
            handler(link, msg)
        except Exception:  # noqa: BLE001 - a bug in handling one message must not drop this host's connection
            _notice(f"mesh {self.name!r}: handling {type(msg).__name__} from host {link.name} failed:\n"
                    f"{traceback.format_exc()}")

    def _on_load(self, link: HostLink, msg: m.HostLoad) -> None:
        for load in msg.loads:
            rank_state = self.state.ranks.get(load.rank)
            if rank_state is not None:
                rank_state.load = load

    def _on_ranks_failed(self, link: HostLink, msg: m.RanksFailed) -> None:
        if link.started is not None and not link.started.done():
            link.started.set_exception(MeshStartError(
                f"mesh {self.name!r}: ranks on host {link.name} failed to start:\n{msg.text}"))

    def _on_rank_exited(self, link: HostLink, msg: m.RankExited) -> None:
        self.debugging.rank_gone(msg.rank, f"rank {msg.rank} exited")
        remote = link.host.remote if link.host is not None else None
        if remote is None or not remote.scheduled or msg.expected:
            self.requests.rank_exited(msg.rank, msg.exit_code, msg.signal, msg.stderr_tail, expected=msg.expected)
            return

        async def with_cause() -> None:  # a rank killed by the scheduler (time limit, scancel): say so
            try:
                cause = await asyncio.wait_for(asyncio.to_thread(remote.job_ended), 5)
            except Exception:  # noqa: BLE001 - reported without it
                cause = ""
            rank_state = self.state.ranks[msg.rank]
            if rank_state.alive and rank_state.pid == msg.pid:  # not reported meanwhile, nor restarted
                self.requests.rank_exited(msg.rank, msg.exit_code, msg.signal, msg.stderr_tail, expected=False,
                                          cause=cause)

        asyncio.get_running_loop().create_task(with_cause())

    def _on_lost(self, link: HostLink, exc: Exception | None) -> None:
        if self.state.closed:
            return
        remote = link.host.remote if link.host is not None else None
        if remote is not None and remote.scheduled:  # a Slurm node: ask Slurm why (off the loop); that answer reports the loss
            if not link.explained:  # (the connection closing after a missed heartbeat is the same loss)
                link.explained = True
                asyncio.get_running_loop().create_task(self._lost_because(link, exc, remote.lost_reason))
            return
        self._host_lost(link, exc)

    async def _lost_because(self, link: HostLink, exc: Exception | None, explain: Callable[[], str]) -> None:
        try:
            reason = await asyncio.wait_for(asyncio.to_thread(explain), 5)
        except Exception:  # noqa: BLE001 - the loss is reported all the same
            reason = ""
        self._host_lost(link, RuntimeError(f"{exc or 'its agent step ended'}{'; ' + reason if reason else ''}"))

    def _host_lost(self, link: HostLink, exc: Exception | None) -> None:
        if self.state.closed:
            return
        why = f"lost the connection to host {link.name}" + (f" ({exc})" if exc else "")
        self.host_ops.lost(link, why)
        for rank in link.ranks:
            self.debugging.rank_gone(rank, why)
        self._end_lost_host(link)
        for rank in link.ranks:
            if self.state.ranks[rank].alive:
                self.requests.rank_exited(rank, None, None, (why,), expected=False, host_lost=True)
        if any(w is not None and not w.done() for w in (link.greeted, link.started)):
            asyncio.get_running_loop().create_task(self._fail_start(link))
        self.relays.lost(link, exc)
        self._cut_off(link.index, f"its relay host {link.name} was lost")

    def _end_lost_host(self, link: HostLink) -> None:
        """A host that stopped answering, on this machine: make sure nothing of it keeps running."""
        if link.host is not None:
            link.host.kill_local([pid for r in link.ranks if (pid := self.state.ranks[r].pid) is not None])

    def _relay_lost(self, host: int, why: str) -> None:
        """A relay link broke: `host` and the hosts below it can no longer be reached for work."""
        link = self.state.links[host] if 0 <= host < len(self.state.links) else None
        if link is None or not self.relays.active:
            return
        self._cut_off(host, f"the relay link to host {link.name} broke: {why}", include=True)

    def _cut_off(self, host: int, why: str, include: bool = False) -> None:
        """Declare lost the hosts below `host` in the relay tree (and `host` with include): their ranks
        fail now, their agents are told to stop."""
        cut = [self.state.links[i] for i in ([host] if include else []) + self.relays.cut_off(host)]
        cut = [link for link in cut if link.is_open]
        if not cut:
            return
        _notice(f"mesh {self.name!r}: {len(cut)} host{'s' if len(cut) > 1 else ''} cut off "
                f"({', '.join(link.name for link in cut)}): {why}; their ranks are lost, the other hosts go on; "
                "%mesh restart (mesh.restart()) brings them back\n")
        for link in cut:
            link.send(m.Shutdown())
            link.close()
        for link in cut:
            self._host_lost(link, RuntimeError(f"cut off from the controller: {why}"))

    def _on_relayed(self, link: HostLink, msg: rm.RelayUp) -> None:
        """Output and results of hosts below `link`'s, combined on the way up (checked for shm names as any)."""
        for inner in msg.msgs:
            handler = self._handlers.get(type(inner))
            if isinstance(inner, RELAYED_UP) and handler is not None:
                handler(link, inner)

    async def _fail_start(self, link: HostLink) -> None:
        why = await link.host.explain_exit(link.log_path) if link.host is not None else "its agent exited"
        for waiting in (link.greeted, link.started):
            if waiting is not None and not waiting.done():
                waiting.set_exception(MeshStartError(f"mesh {self.name!r}: host {link.name}: {why}"))


@atexit.register
def _shutdown_open_meshes() -> None:
    """The one exit hook: meshes never shut down stop and leave no files, then the loop ends (as Session.close)."""
    for runtime in list(MeshRuntime._open):
        try:
            runtime.leave()
        except Exception:  # noqa: BLE001 - best effort while the interpreter exits
            pass
    ControllerLoop.stop()


def settle(future: asyncio.Future[Any] | None, value: Any) -> None:
    """Resolve a future someone may be waiting on (nothing if there is none, or it is done)."""
    if future is not None and not future.done():
        future.set_result(value)


RELAYED_UP = (m.Output, m.Display, m.Gathered)  # what may come up a relay tree (see agent/relays.py)


def _notice(text: str) -> None:
    """Tell the notebook something about the mesh as a whole (it lands in the running cell)."""
    try:
        sys.stderr.write(f"monarch_kernel: {text}")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
