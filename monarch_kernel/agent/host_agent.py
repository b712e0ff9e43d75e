"""The host agent: one per host, between the controller and that host's ranks.

It routes each request to its local ranks with one encoding and gathers their replies
into one message, routes actor calls between ranks (those of this host directly, the
rest through the controller), relays output, and watches the controller: if it falls
silent, every rank is stopped rather than left behind. The ranks themselves (fork,
reap, heartbeats, load) are kept by its `RankSet`.

Run as `python -m monarch_kernel.agent --fd N --host NAME` with the controller's end of
a socketpair inherited as fd N (or `--stdio` over SSH, on stdin/stdout).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from monarch_kernel.agent.descendants import kill_descendants
from monarch_kernel.agent.fd_output import FdOutput
from monarch_kernel.agent.host_shm import HostShm
from monarch_kernel.agent.launcher import RankProcess
from monarch_kernel.agent.ops import HostOperations
from monarch_kernel.agent.persistence import Persistence
from monarch_kernel.agent.preload import Preloader
from monarch_kernel.agent.rank_set import RankSet, tail_text
from monarch_kernel.agent.relays import UP_TYPES, AgentRelays
from monarch_kernel.core.failures import exit_text
from monarch_kernel.core.output_caps import MAX_FD_OUTPUT_PER_REQUEST
from monarch_kernel.core.versions import __version__
from monarch_kernel.wire import handshake
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import persist_messages as pm
from monarch_kernel.wire import relay_messages as rm
from monarch_kernel.wire.debugging import DebugToRank
from monarch_kernel.wire.diagnosis import InspectRanks
from monarch_kernel.wire.relay_link import RelayLink
from monarch_kernel.wire.routing import CallRouter, Send
from monarch_kernel.wire.serialization import Sealed, release
from monarch_kernel.wire.transport import AsyncConnection, encode

# work for the ranks that keeps the order it was sent in, behind a push being copied off the loop
IN_ORDER = (m.ToRanks, m.ActorCall, m.InterruptRanks, m.InputReply, m.CancelCall, rm.RelayDown)

class HostAgent:
    """Routes between one controller connection and this host's ranks."""

    def __init__(self, host: str, mesh_folders: tuple[str, ...] = ()):
        self.host = host
        self.mesh_folders = mesh_folders  # the kernel's folders of the mesh (a persistent mesh keeps them)
        self.persistence: Persistence | None = None  # the mesh outlives its kernel (`Persist`)
        self.ended_without_kernel = False  # a persistent mesh stopped with no kernel holding it (its exit status says)
        self.preloader = Preloader()
        self.ranks = RankSet(host, self, self.preloader)
        self.pending: dict[int, tuple[set[int], list[m.Result]]] = {}  # req_id -> (waiting ranks, results)
        self.controller: AsyncConnection | RelayLink | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_heard = time.monotonic()
        self._outbox: list[Any] = []
        self.last_load = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._fd_output = FdOutput()
        self._fd_limit_held: int | None = MAX_FD_OUTPUT_PER_REQUEST  # the cap while a kernel holds the mesh
        self._host_ops = HostOperations()  # workspace files and the like: in order, off the loop
        self._copying = False  # a push is being copied: work for the ranks waits in _backlog
        self._backlog: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self.shm = HostShm()  # values for several ranks, written once to shared memory
        self._release_when_gathered: dict[int, Sealed] = {}
        self._release_when_answered: dict[tuple[int, int], tuple[Sealed, set[int]]] = {}  # shared call arguments
        self.router = CallRouter(next_hop=self._hop, serves=lambda rank: rank in self.ranks.local_ranks,
                                 why_dead=lambda rank: f"rank {rank} on {host} is not running",
                                 upstream=self.to_controller)
        self._from_controller: dict[type, Callable[[Any], None]] = {
            m.ToRanks: self._fan_out,
            m.InterruptRanks: self._deliver,  # each rank decides what to stop (worker.py)
            InspectRanks: self._deliver,  # each rank's reader thread answers
            DebugToRank: self._deliver,  # (to the rank's reader thread: it flows while the rank is paused)
            m.ActorCall: lambda msg: self._call(msg, from_above=True),
            m.ActorReply: self.router.reply,
            m.CancelCall: lambda msg: self.router.cancel(msg, from_above=True),
            m.InputReply: self._deliver,
            m.DirectRoute: self._deliver,  # (to the rank: the lanes of another mesh's ranks on this machine)
            m.ListenForCalls: self._deliver,  # (to the ranks: other hosts' ranks of other meshes will call them)
            m.Ping: lambda msg: self.to_controller(m.Pong(msg.seq)),
            m.Preload: lambda msg: self.preloader.start(msg.modules),
            m.BindStore: lambda msg: self._bind_store(msg.addr),
            m.StartRanks: lambda msg: self._spawn(self._start(msg)),
            m.Shutdown: lambda msg: self._spawn(self.shutdown("the controller asked", asked=True)),
            pm.Persist: lambda msg: self._spawn(self._persist(msg)),
            pm.PersistRecorded: lambda msg: self.persistence.recorded_by_kernel() if self.persistence else None,
            m.HostOp: lambda msg: self._spawn(self._host_ops.run(msg, self.to_controller)),
            rm.RelayServe: lambda msg: self._spawn(self.relays.serve(msg)),
            rm.RelayJoin: lambda msg: self._spawn(self.relays.join(msg)),
            rm.RelayDown: lambda msg: self.relays.down(msg),
            rm.RelayStop: lambda msg: self.relays.stop(),
        }
        self.relays = AgentRelays(self._send_controller, self._fan_out)  # its place in a relay tree, if any
        self._from_rank: dict[type, Callable[[int, Any], None]] = {
            m.Result: self._result,
            m.ActorReply: self._reply_from_rank,  # (msg.mesh: a Port of another mesh's rank)
            m.ActorCall: lambda rank, msg: self.to_controller(msg) if msg.mesh else self._call(msg),
            m.CancelCall: lambda rank, msg: self.to_controller(msg) if msg.mesh else self.router.cancel(msg),
        }
        for upward in (m.OwnActors, m.BroadcastFailed, m.ActorFailed, m.ProcsRequest, m.ListeningForCalls):  # the controller's
            self._from_rank[upward] = lambda rank, msg: self.to_controller(msg)

    # ------------------------------------------------------------ the controller
    def connected(self, conn: AsyncConnection | RelayLink) -> None:
        """The controller connection is ready: say who we are, then send what was queued meanwhile."""
        self.controller = conn
        self._fd_output.limit = self._fd_limit_held
        conn.send(handshake.hello(__version__))
        for msg in self._outbox:
            conn.send(msg)
        self._outbox.clear()

    def on_controller_message(self, msg: Any) -> None:
        """Dispatch one message from the controller.

        A failure in our own handling (a full /dev/shm, a bug) is reported to the controller and
        the agent goes on: escaping here would close the link and stop every rank of the host.
        """
        self.last_heard = time.monotonic()
        handler = self._from_controller.get(type(msg))
        if handler is not None and not (isinstance(msg, IN_ORDER) and self._in_order(handler, msg)):
            self._dispatch(handler, msg)

    def _dispatch(self, handler: Callable[[Any], None], msg: Any) -> None:
        try:
            handler(msg)
        except Exception as exc:  # noqa: BLE001 - reported; the link and the ranks stay
            self._report_failure(f"handling {type(msg).__name__} from the controller", exc)
            if isinstance(msg, m.ToRanks):
                self._fail_request(msg, exc)

    def on_controller_closed(self, exc: Exception | None) -> None:
        """The controller is gone: take every rank down (a persistent mesh whose record the kernel wrote waits
        for the next kernel; one without a record could be found by nobody)."""
        if self.persistence is None or not self.persistence.recorded:
            why = "" if self.persistence is None else ", before it recorded the persistent mesh"
            self._spawn(self.shutdown(f"the controller connection closed{why} ({exc})"))
        elif self.controller is not None and self.controller.closed and not self.done.done():
            self.controller = None
            self._fd_output.limit = MAX_FD_OUTPUT_PER_REQUEST  # (no controller caps it while none is attached)
            self.persistence.detach(f"the controller connection closed ({exc})")

    async def _persist(self, msg: pm.Persist) -> None:
        self.persistence = await Persistence(self, self.ranks, msg, self.mesh_folders).listen()
        self.to_controller(pm.PersistReady(os.getpid(), self.persistence.socket_path))

    def take_over(self, notice: pm.TakenOver) -> None:
        """Another kernel takes the mesh: the one holding it hears so, and its link goes."""
        old, self.controller = self.controller, None
        if old is not None:
            old.pause_reading()  # (nothing more of the old kernel's is dispatched, not even for the next 0.1 s)
            old.send(notice)
            asyncio.get_running_loop().call_later(0.1, old.close)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a coroutine on the agent's loop (kept referenced until it ends)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def to_controller(self, msg: Any) -> None:
        """Send to the controller: output and results up the relay tree when this agent is in one."""
        if self.relays.active and isinstance(msg, UP_TYPES):
            self.relays.up(msg)
        else:
            self._send_controller(msg)

    def _send_controller(self, msg: Any) -> None:
        if self.controller is None and self.persistence is not None:
            self.persistence.hold(msg)  # no kernel holds the mesh now: the next one gets it
        elif self.controller is None:
            self._outbox.append(msg)  # the connection is still being set up
        elif not self.controller.closed:
            self.controller.send(msg)

    def _fan_out(self, msg: m.ToRanks) -> None:
        if len(msg.ranks) > 1 and self.shm.worth_sharing(msg.body):
            # the copy into shared memory runs off the loop (2.3 s/GiB here): pongs, heartbeats and
            # output keep flowing meanwhile, and the work sent after it waits its turn (_in_order)
            self._copying = True
            self._spawn(self._fan_out_shared(msg))
            return
        self._send_fanned(msg, msg.body)

    async def _fan_out_shared(self, msg: m.ToRanks) -> None:
        try:
            body, problem = await self.shm.share_off_loop(msg.body)
            if problem is not None:
                self._report_failure("writing a push for several ranks to shared memory", problem)
            self._send_fanned(msg, body)
        except Exception as exc:  # noqa: BLE001 - the request ends with the reason; the agent goes on
            self._report_failure(f"passing request {msg.body.req_id} on", exc)
            self._fail_request(msg, exc)
        finally:
            self._copying = False
            self._drain_backlog()

    def _send_fanned(self, msg: m.ToRanks, body: Any) -> None:
        req_id = msg.body.req_id
        for rank in msg.ranks:
            self._fd_note(rank, None)
        self._fd_output.refill(msg.ranks)
        chunks = encode(body)
        waiting = {rank for rank in msg.ranks if self.ranks.send(rank, chunks)}  # dead ones: already known
        self.pending[req_id] = (waiting, [])
        if body is not msg.body:
            self._release_when_gathered[req_id] = self.shm.shared_value(body)
        self._maybe_gathered(req_id)

    def _in_order(self, handler: Callable[[Any], None], msg: Any) -> bool:
        """Queue work for the ranks behind a push still being copied (True if queued)."""
        if not (self._copying or self._backlog):
            return False
        self._backlog.append((handler, msg))
        return True

    def _drain_backlog(self) -> None:
        while self._backlog and not self._copying:
            handler, msg = self._backlog.popleft()
            self._dispatch(handler, msg)

    def _call(self, msg: m.ActorCall, from_above: bool = False) -> None:
        """Route an actor call; its large arguments are written once to this host's shared memory for
        the several ranks of this host it goes to (each maps them), released once they all answered.
        A call from the controller is copied off the loop (a GiB takes a second): the work it sends later
        waits its turn (`_in_order`). One from a rank of this host is copied here (its order with that rank's
        next calls is kept by this loop alone)."""
        local = tuple(r for r in msg.ranks if r in self.ranks.local_ranks)
        if len(local) > 1 and self.shm.worth_sharing(msg):
            if from_above:
                self._copying = True
                self._spawn(self._call_shared(msg, local, from_above))
            else:
                self._route_shared(msg, local, from_above, self.shm.share(dataclasses.replace(msg, ranks=local)))
            return
        self.router.call(msg, from_above=from_above)

    async def _call_shared(self, msg: m.ActorCall, local: tuple[int, ...], from_above: bool) -> None:
        try:
            self._route_shared(msg, local, from_above,
                               await self.shm.share_off_loop(dataclasses.replace(msg, ranks=local)))
        except Exception as exc:  # noqa: BLE001 - the call is routed unshared; the agent goes on
            self._report_failure(f"sharing actor call {msg.call_id}'s arguments", exc)
            self.router.call(msg, from_above=from_above)
        finally:
            self._copying = False
            self._drain_backlog()

    def _route_shared(self, msg: m.ActorCall, local: tuple[int, ...], from_above: bool,
                      sharing: tuple[Any, Exception | None]) -> None:
        shared, problem = sharing
        if problem is not None:
            self._report_failure("writing an actor call's arguments to shared memory", problem)
        if shared.args is not msg.args:  # (only these ranks may see the file names: not the controller)
            self._release_when_answered[(msg.caller, msg.call_id)] = (shared.args, set(local))
            rest = tuple(r for r in msg.ranks if r not in local)
            if rest:
                self.router.call(dataclasses.replace(msg, ranks=rest), from_above=from_above)
            msg = shared
        self.router.call(msg, from_above=from_above)

    def _reply_from_rank(self, rank: int, msg: m.ActorReply) -> None:
        if msg.mesh:  # to a Port that a rank of another mesh opened: its controller side takes it
            self.to_controller(msg)
            return
        self._answered_shared(msg.caller, msg.call_id, rank)
        self.router.reply(msg, owed=True)

    def _answered_shared(self, caller: int, call_id: int, rank: int) -> None:
        entry = self._release_when_answered.get((caller, call_id))
        if entry is not None:
            entry[1].discard(rank)
            if not entry[1]:
                del self._release_when_answered[(caller, call_id)]
                release(entry[0])  # each rank holds its own link while it maps the arguments

    def _deliver(self, msg: m.InputReply | m.InterruptRanks | InspectRanks | DebugToRank | m.DirectRoute
                 | m.ListenForCalls) -> None:
        """Pass a message on to the local ranks it names."""
        chunks = encode(msg)
        for rank in msg.ranks:
            self.ranks.send(rank, chunks)

    def _maybe_gathered(self, req_id: int) -> None:
        waiting, results = self.pending[req_id]
        if not waiting:
            del self.pending[req_id]
            shared = self._release_when_gathered.pop(req_id, None)
            if shared is not None:
                release(shared)  # every rank answered: each holds its own link while it maps the values
            self.to_controller(m.Gathered(req_id, tuple(results)))

    def _hop(self, rank: int) -> Send | None:
        proc = self.ranks.procs.get(rank)
        if proc is None or proc.conn is None or proc.conn.closed:
            return None
        return proc.conn.send

    # ------------------------------------------------------------ the ranks (RankListener)
    def on_rank_message(self, rank: int, msg: Any) -> None:
        """Route one message from a rank (a failure in our handling is reported, as above)."""
        try:
            self._route_from_rank(rank, msg)
        except Exception as exc:  # noqa: BLE001 - reported; the rank's link stays
            self._report_failure(f"handling {type(msg).__name__} from rank {rank}", exc)

    def _report_failure(self, what: str, exc: Exception) -> None:
        text = f"monarch_kernel agent on {self.host}: {what} failed: {type(exc).__name__}: {exc}"
        try:
            traceback.print_exc(file=sys.stderr)
            print(text, file=sys.stderr, flush=True)
        except OSError:
            pass
        self._send_controller(m.AgentProblem(text))

    def _fail_request(self, msg: m.ToRanks, exc: Exception) -> None:
        """A request the agent could not pass on: its ranks answer with the reason, so the cell ends."""
        self.pending.pop(msg.body.req_id, None)
        now = time.time()
        failure = m.Failure("AgentError", f"the agent on {self.host} could not pass this request on: "
                                          f"{type(exc).__name__}: {exc}", "")
        self.to_controller(m.Gathered(msg.body.req_id, tuple(m.Result(msg.body.req_id, rank, None, failure, now, now)
                                                              for rank in msg.ranks)))

    def _route_from_rank(self, rank: int, msg: Any) -> None:
        handler = self._from_rank.get(type(msg))
        if handler is not None:
            handler(rank, msg)
            return
        if isinstance(msg, m.Output) and msg.stream == "stderr":
            self.ranks.remember_stderr(rank, msg.text)
        self.to_controller(msg)

    def _result(self, rank: int, msg: m.Result) -> None:
        self._fd_note(rank, msg.req_id)
        entry = self.pending.get(msg.req_id)
        if entry is not None:
            entry[0].discard(rank)
            entry[1].append(msg)
            self._maybe_gathered(msg.req_id)
        else:  # a request the notebook sent on the rank's lane, whose lane closed before the result
            self.to_controller(m.Gathered(msg.req_id, (msg,)))

    def _fd_note(self, rank: int, req_id: int | None) -> None:
        note = self._fd_output.settle(rank)
        if note:
            self.to_controller(m.Output(rank, req_id, "stderr", note))

    def on_rank_fd_output(self, rank: int, stream: str, data: bytes, total: int | None) -> None:
        """Text a rank wrote to its real fd 1/2 (C extensions, crashes); with its running byte
        count on the notebook's machine, sent even when no whole character came (fd_marks.py)."""
        text = self._fd_output.take(rank, stream, data)
        if text or total is not None:
            self.to_controller(m.Output(rank, None, stream, text, total))

    def on_rank_gone(self, rank: int, proc: RankProcess, exit_code: int | None, signal_name: str | None) -> None:
        """A rank's process ended: fail what it owed, tell the controller, release its waits."""
        self.router.rank_died(rank, f"rank {rank} on {self.host} (pid {proc.pid}) died "
                                    f"({exit_text(exit_code, signal_name)}) before answering" + tail_text(proc))
        self.to_controller(m.RankExited(rank, proc.pid, exit_code, signal_name, tuple(proc.stderr_tail.texts()),
                                         proc.stopping))
        for req_id in list(self.pending):
            self.pending[req_id][0].discard(rank)
            self._maybe_gathered(req_id)
        for caller, call_id in list(self._release_when_answered):
            self._answered_shared(caller, call_id, rank)

    def on_rank_health(self, rank: int, responsive: bool) -> None:
        """A rank stopped (or resumed) answering heartbeats."""
        self.to_controller(m.RankHealth(rank, responsive))

    def on_went_idle(self) -> None:
        """A rank stopped being busy: say so now, not at the next load sample."""
        self.send_loads()

    # ------------------------------------------------------------ lifecycle
    async def _start(self, msg: m.StartRanks) -> None:
        if msg.shm_dir:  # the notebook's machine: requests come on lanes, the controller caps their fd output
            self._fd_output.limit = self._fd_limit_held = None
        try:
            infos = await self.ranks.start(msg)
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            await self.ranks.stop_all(0.5)
            self.to_controller(m.RanksFailed(f"{self.host}: {exc}"))
            return
        self.to_controller(m.RanksStarted(infos))

    def _bind_store(self, addr: str) -> None:
        try:
            port = self.ranks.bind_store(addr)
        except OSError as exc:
            self.to_controller(m.RanksFailed(
                f"{self.host}: cannot listen on MASTER_ADDR {addr} for the rendezvous store ({exc}); "
                "pass an address of this host (master_addr=...)"))
            return
        self.to_controller(m.StoreBound(port))

    async def shutdown(self, why: str, *, asked: bool = False) -> None:
        """Stop all ranks and end the agent (asked: by the controller, so the exits are expected)."""
        if self.done.done():
            return
        try:  # the log is the SSH channel's stderr: it may be gone with the controller
            print(f"monarch_kernel agent on {self.host}: shutting down: {why}", file=sys.stderr, flush=True)
        except OSError:
            pass
        try:
            self.relays.stop()
            await asyncio.wait_for(self.ranks.stop_all(0.5, asked=asked), timeout=3)
        finally:
            self.ranks.kill_all()
            kill_descendants(keep=self.ranks.pids())  # helpers that left their rank's group
            self.ranks.close()
            self.shm.close()
            if self.persistence is not None:
                self.persistence.close()
            if self.controller is not None:
                self.controller.close()
            if not self.done.done():
                self.done.set_result(None)

    def send_loads(self) -> None:
        """Each rank's load now, to the controller."""
        self.last_load = time.monotonic()
        loads = self.ranks.loads()
        if loads:
            self.to_controller(m.HostLoad(tuple(loads)))
