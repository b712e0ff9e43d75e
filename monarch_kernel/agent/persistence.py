"""A persistent mesh's agent: it outlives its kernel, keeps what the ranks say meanwhile, and lets
the next kernel attach.

Once told `Persist`, the agent listens on a Unix socket in the mesh's 0700 folder. A peer must run
as our own user (SO_PEERCRED) and prove the mesh's secret in an ephemeral key exchange
(`wire/direct_auth`), after which every frame is encrypted under the session's keys (`wire/relay_link`).
On a Slurm node it listens on the node's numeric address instead, with connections in their handshake
bounded (`wire/handshake_gate`). Its one request says what it wants:
attach (refused while another live kernel holds the mesh, unless it takes it over), a query for
listings, or a stop. While no kernel holds the mesh, what the ranks send for one (output, results,
deaths) is kept, the output bounded per rank, and handed to the next kernel; after `seconds`
without a kernel the mesh stops itself and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Protocol

from monarch_kernel.agent.launcher import RankProcess
from monarch_kernel.agent.rank_set import RankSet
from monarch_kernel.core.addresses import numeric_address
from monarch_kernel.core.folders import owned_folder, release_folder, share_folder
from monarch_kernel.core.versions import __version__
from monarch_kernel.wire import handshake
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import persist_messages as pm
from monarch_kernel.wire.direct_auth import AuthenticationFailed, check_controller_async
from monarch_kernel.wire.handshake_gate import ACCEPT_BACKLOG, HandshakeGate
from monarch_kernel.wire.lanes import peer_credentials, peer_is_us
from monarch_kernel.wire.relay_link import UP, RelayLink
from monarch_kernel.wire.transport import FrameError

HELD_LINES_PER_RANK = 10_000  # output lines kept per rank while no kernel is attached
HELD_CHARS_PER_RANK = 8 << 20  # ... and characters: a progress bar without newlines is one endless "line"
BATCH_CHARS = 4 << 20  # what was held goes to the next kernel in frames of about this much text
HELD_MESSAGES = 2_000  # results and deaths kept (oldest dropped past it)
KEPT = (m.Output, m.Gathered, m.RankExited, m.AgentProblem)  # what is worth handing to the next kernel
REQUEST_TIMEOUT_S = 5.0  # an authenticated peer says what it wants within this
HANDSHAKE_TIMEOUT_S = 2.0  # a connecting kernel proves the secret within this
FRESH_HEARTBEATS_S = 5.0  # at an attach, the ranks say what they run within this (half the kernel's attach timeout)


class PersistentHost(Protocol):
    """What the agent offers its persistence (`host_agent.HostAgent`)."""

    last_heard: float  # when the controller last said something
    ended_without_kernel: bool  # the mesh stops with no kernel to release what holds it (the exit status says)

    def connected(self, conn: Any) -> None:
        """A new controller link: say hello, then the rest."""

    async def shutdown(self, why: str, *, asked: bool = False) -> None:
        """Stop every rank and end the agent."""

    def on_controller_message(self, msg: Any) -> None:
        """One message from the kernel holding the mesh."""

    def on_controller_closed(self, exc: Exception | None) -> None:
        """The link to the kernel holding the mesh ended."""

    def take_over(self, notice: pm.TakenOver) -> None:
        """Tell the kernel holding the mesh that another takes it, and drop its link."""


class Persistence:
    """The agent's part of a persistent mesh (made when `Persist` arrives)."""

    def __init__(self, host: PersistentHost, ranks: RankSet, msg: pm.Persist, folders: tuple[str, ...]):
        self.host = host
        self.ranks = ranks
        self.seconds = msg.seconds
        self.socket_path = msg.socket
        self.record = msg.record
        self._secret = msg.secret
        self.same_machine = bool(msg.socket) and not msg.socket.startswith("tcp:")  # (else reached over SSH or TCP)
        self.holder: pm.Holder | None = msg.holder
        self.recorded = False  # the kernel wrote the mesh's record (until then, the link's end ends the mesh)
        self.detached_since: float | None = None
        self.folders = folders
        self._seq = itertools.count()  # (the order everything held was sent in)
        self._held: collections.deque[tuple[int, Any]] = collections.deque(maxlen=HELD_MESSAGES)  # results, deaths
        self._lines: dict[int, collections.deque[tuple[int, Any]]] = {}  # rank -> its output, line-bounded
        self._line_counts: dict[int, int] = {}
        self._char_counts: dict[int, int] = {}
        self._labels: dict[int, str] = {}
        self.dropped_lines = 0
        self._server: asyncio.AbstractServer | None = None
        self._gate = HandshakeGate(f"the persistent mesh's listener on {msg.socket or 'this host'}", _log)
        self._expiry: asyncio.Task[None] | None = None

    async def listen(self) -> Persistence:
        """Listen for the next kernels (owner-only socket in the mesh's private folder); hold its folders."""
        for folder in self.folders:  # a sweep by another kernel must not take them once ours is gone
            share_folder(folder)
        if self.socket_path.startswith("tcp:"):  # a Slurm node: the direct link's kind of listener, on its address
            address = numeric_address(self.socket_path[4:])  # (one literal address, as said: never every one of a name)
            self._server = await asyncio.start_server(self._accept, host=address, port=0, limit=1 << 22,
                                                      backlog=ACCEPT_BACKLOG)
            host, port = self._server.sockets[0].getsockname()[:2]
            self.socket_path = f"tcp:{host}:{port}"
            return self
        if not self.socket_path:  # an SSH host: a private folder of its own, reported back
            own = owned_folder(tempfile.mkdtemp(prefix="monarch-persist-"))  # (swept if this agent is SIGKILLed)
            self.socket_path, self.folders = os.path.join(own, "agent.sock"), (*self.folders, own)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        self._server = await asyncio.start_unix_server(self._accept, sock=listener, limit=1 << 22)
        return self

    def recorded_by_kernel(self) -> None:
        """The kernel wrote the record: the next kernel can find the mesh, so the link's end is a detach now."""
        self.recorded = True

    # ------------------------------------------------------------ without a kernel
    def detach(self, why: str) -> None:
        """The kernel holding the mesh went away: keep the ranks, start the clock."""
        self.holder = None
        self.detached_since = time.monotonic()
        _log(f"no kernel holds the mesh now ({why}); it stops itself after {self.seconds:.0f} s without one")
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        while self.detached_since is not None:
            left = self.detached_since + self.seconds - time.monotonic()
            if left <= 0:
                self.host.ended_without_kernel = True
                await self.host.shutdown(f"no kernel attached for {self.seconds:.0f} s", asked=True)
                return
            await asyncio.sleep(min(left, 1.0))

    def hold(self, msg: Any) -> None:
        """Keep what the ranks sent for a kernel while none is attached (bounded)."""
        if not isinstance(msg, KEPT):
            return
        if isinstance(msg, m.Output):
            self._hold_output(msg)
            return
        if isinstance(msg, m.Gathered):
            for result in msg.results:
                self._name(result.rank, result.req_id)
        self._held.append((next(self._seq), msg))

    def _hold_output(self, msg: m.Output) -> None:
        if msg.req_id is not None:
            self._name(msg.rank, msg.req_id)
        if len(msg.text) > HELD_CHARS_PER_RANK:  # (one huge message: its end is what a reader wants)
            self.dropped_lines += msg.text.count("\n", 0, len(msg.text) - HELD_CHARS_PER_RANK)
            msg = dataclasses.replace(msg, text=msg.text[-HELD_CHARS_PER_RANK:])
        lines = self._lines.setdefault(msg.rank, collections.deque())
        lines.append((next(self._seq), msg))
        count = self._line_counts.get(msg.rank, 0) + msg.text.count("\n") + 1
        chars = self._char_counts.get(msg.rank, 0) + len(msg.text)
        while (count > HELD_LINES_PER_RANK or chars > HELD_CHARS_PER_RANK) and len(lines) > 1:
            _, dropped = lines.popleft()
            count -= dropped.text.count("\n") + 1
            chars -= len(dropped.text)
            self.dropped_lines += dropped.text.count("\n") + 1
        self._line_counts[msg.rank], self._char_counts[msg.rank] = count, chars

    def _name(self, rank: int, req_id: int) -> None:
        if req_id not in self._labels:
            proc = self.ranks.procs.get(rank)
            label = proc.requests.get(req_id, "") if proc is not None else ""
            if label:
                self._labels[req_id] = label

    def _take_held(self) -> tuple[Any, ...]:
        held = tuple(msg for _, msg in sorted([*self._held, *(e for lines in self._lines.values() for e in lines)],
                                              key=lambda entry: entry[0]))
        self._held.clear()
        self._lines.clear()
        self._line_counts.clear()
        self._char_counts.clear()
        return held

    # ------------------------------------------------------------ kernels that come
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        unix = sock is not None and sock.family == socket.AF_UNIX  # (on TCP the secret's proof alone decides)
        token = self._gate.admit(writer)
        try:
            if sock is None or (unix and not peer_is_us(sock)):  # (the folder is private too)
                raise AuthenticationFailed("the peer runs as another user")
            session = await check_controller_async(reader, writer, self._secret, timeout=HANDSHAKE_TIMEOUT_S)
        except (AuthenticationFailed, OSError) as exc:
            self._gate.refuse(token, str(exc))
            return
        self._gate.done(token)
        first: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        then: list[Any] = []  # once attached: where the kernel's messages and the link's end go

        def on_message(msg: Any) -> None:
            if then:
                then[0](msg)
            elif not first.done():
                first.set_result(msg)

        def on_close(exc: Exception | None) -> None:
            if then:
                then[1](exc)
            elif not first.done():
                first.set_exception(exc or ConnectionError("closed"))

        link = RelayLink(reader, writer, session, UP, on_message, on_close)
        try:
            request = await asyncio.wait_for(first, REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError, FrameError) as exc:
            _log(f"an authenticated peer said nothing usable ({type(exc).__name__}); closed")
            link.close()
            return
        await self._serve(link, request, peer_credentials(sock)[0] if unix else 0, then)

    async def _serve(self, link: RelayLink, request: Any, pid: int, then: list[Any]) -> None:
        if isinstance(request, pm.MeshQuery):
            link.send(self.info())
        elif isinstance(request, pm.StopMesh):
            link.send(pm.MeshInfo(None, 0.0, None, ()))
            self.host.ended_without_kernel = True
            await self.host.shutdown(f"stopped by pid {pid} (meshes stop)", asked=True)
        elif isinstance(request, pm.AttachRequest):
            await self._fresh_heartbeats()  # (which requests still run: the next kernel follows them)
            if self._attach(link, request, pid):
                then.extend((self.host.on_controller_message, self.host.on_controller_closed))
            return
        await asyncio.sleep(0.05)  # (let the answer leave before the link closes)
        link.close()

    def _attach(self, link: RelayLink, request: pm.AttachRequest, pid: int) -> bool:
        # here, the peer's pid is the kernel's; over SSH it is sshd's, over TCP there is none: then as it says
        holder = pm.Holder(pid if self.same_machine else request.holder.pid, request.holder.notebook, time.time())
        if self.holder is not None and not request.take:
            link.send(handshake.hello(__version__))
            link.send(pm.AttachRefused(self.holder))
            asyncio.get_running_loop().call_later(0.05, link.close)
            return False
        if self.holder is not None:  # taken over: the old kernel hears it, its link goes
            self.host.take_over(pm.TakenOver(holder))
        detached_for = time.monotonic() - self.detached_since if self.detached_since is not None else 0.0
        self.detached_since = None
        self.holder = holder
        for rank, proc in self.ranks.procs.items():  # (what those still running are called)
            if proc.running is not None:
                self._name(rank, proc.running)
        self.host.last_heard = time.monotonic()  # (the silence watch counts from the attach)
        self.host.connected(link)  # (its hello first; nothing can come between it and what follows)
        held = self._take_held()
        start = 0
        while start < len(held):  # in frames of about BATCH_CHARS of text each, the last inside Attached
            end, size = start, 0
            while end < len(held) and (end == start or size < BATCH_CHARS):
                size += len(getattr(held[end], "text", "")) + 256
                end += 1
            if end == len(held):
                break
            link.send(pm.HeldBatch(held[start:end]))
            start = end
        link.send(pm.Attached(self.rank_states(), detached_for, held[start:], dict(self._labels),
                              self.dropped_lines))
        self._labels.clear()
        self.dropped_lines = 0
        _log(f"attached by pid {pid}" + (" (taken over)" if request.take else ""))
        return True

    def rank_states(self) -> tuple[pm.DetachedRank, ...]:
        """Each rank of this host as the agent knows it."""
        procs = self.ranks.procs
        return tuple(pm.DetachedRank(r, procs[r].pid, True, procs[r].activity, _fd_total(procs[r]), procs[r].running,
                                     procs[r].requests.get(procs[r].running or -1, ""))
                     if r in procs else pm.DetachedRank(r, 0, False, "", 0) for r in sorted(self.ranks.local_ranks))

    async def _fresh_heartbeats(self, timeout: float = FRESH_HEARTBEATS_S) -> None:
        """Ask every rank what it runs now and wait for each answer (their heartbeat threads answer even while
        a cell runs, but only once they get the GIL: a C call that holds it, or a loaded machine, delays them;
        a request whose rank has not answered would be taken for one that ended)."""
        asked = time.monotonic()
        self.ranks.ping(asked)
        while time.monotonic() - asked < timeout and any(p.last_pong < asked for p in self.ranks.procs.values()):
            await asyncio.sleep(0.01)
        silent = sorted(rank for rank, p in self.ranks.procs.items() if p.last_pong < asked)
        if silent:
            _log(f"ranks {silent} did not say within {timeout:.0f} s what they run; the attaching kernel "
                 f"takes what they said last")

    def info(self) -> pm.MeshInfo:
        """How the mesh is now (for listings)."""
        if self.detached_since is None:
            return pm.MeshInfo(self.holder, 0.0, None, self.rank_states())
        idle = time.monotonic() - self.detached_since
        return pm.MeshInfo(None, idle, max(0.0, self.seconds - idle), self.rank_states())

    # ------------------------------------------------------------ the end
    def close(self) -> None:
        """The mesh ends: no more kernels; its record, socket and folders go."""
        self.detached_since = None
        if self._server is not None:
            self._server.close()
        self._gate.close()
        if not self.socket_path.startswith("tcp:"):
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
        remove_record_file(self.record)
        for folder in self.folders:
            release_folder(folder)
            shutil.rmtree(folder, ignore_errors=True)


def remove_record_file(path: str) -> None:
    """Remove the mesh's state file, if it still names this agent (a newer mesh of that name may have
    replaced it); never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            mine = json.loads(f.read(1 << 20)).get("agent_pid") == os.getpid()
        if mine:
            os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass


def _fd_total(proc: RankProcess) -> int:
    return proc.fd_mark.count if proc.fd_mark is not None else 0


def _log(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"monarch_kernel agent: {text}", file=sys.stderr, flush=True)

