"""The ranks of one host, as its agent keeps them: fork, watch, reap, stop, sample.

`RankSet` forks each rank from the warm agent process, learns of its exit through a
pidfd (with its status), pings it for liveness, samples its load, and stops the whole
process group of each rank when told to. What ranks send and what becomes of them is
reported to a `RankListener` (the agent's router).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import replace
from typing import Any, Protocol

from monarch_kernel.agent.launcher import RankProcess, drain_outputs, fork_rank
from monarch_kernel.agent.load import LoadSampler
from monarch_kernel.agent.preload import Preloader
from monarch_kernel.core.failures import exit_text
from monarch_kernel.rank.dist import StoreSpec
from monarch_kernel.wire import messages as m


class RankListener(Protocol):
    """Who hears what the ranks of a RankSet say and do (the host agent)."""

    def on_rank_message(self, rank: int, msg: Any) -> None:
        """A message from a rank."""

    def on_rank_fd_output(self, rank: int, stream: str, data: bytes, total: int | None) -> None:
        """Bytes a rank wrote to its real fd 1 or 2 (total: see wire/fd_marks.py)."""

    def on_rank_gone(self, rank: int, proc: RankProcess, exit_code: int | None, signal_name: str | None) -> None:
        """A rank's process ended and was reaped."""

    def on_rank_health(self, rank: int, responsive: bool) -> None:
        """A rank stopped (or resumed) answering heartbeats."""

    def on_went_idle(self) -> None:
        """A rank that ran actor endpoints is idle now."""


class RankSet:
    """This host's rank processes."""

    def __init__(self, host: str, listener: RankListener, preloader: Preloader | None = None):
        self.host = host
        self.listener = listener
        self.preloader = preloader or Preloader()
        self.procs: dict[int, RankProcess] = {}
        self.local_ranks: set[int] = set()  # every rank of this host, alive or not
        self.health = m.HealthTimings()
        self._store_sock: socket.socket | None = None
        self._folder: str | None = None  # private folder for a FileStore (hosts without shm_dir)
        self._sampler = LoadSampler()
        self._starting = asyncio.Lock()

    def pids(self) -> list[int]:
        """The pids of the rank processes not yet reaped."""
        return [proc.pid for proc in self.procs.values()]

    # ------------------------------------------------------------ sending
    def send(self, rank: int, chunks: list[Any]) -> bool:
        """Send an encoded frame to a rank if it is running; False if it is not."""
        proc = self.procs.get(rank)
        if proc is None or proc.conn is None or proc.conn.closed:
            return False
        proc.conn.send_chunks(chunks)
        return True

    # ------------------------------------------------------------ starting
    def bind_store(self, addr: str) -> int:
        """Listen for rank 0's rendezvous store on addr; the port (raises OSError)."""
        from monarch_kernel.rank.dist import bind_store_socket

        self._close_store_socket()
        self._store_sock = bind_store_socket(addr)
        return int(self._store_sock.getsockname()[1])

    def _store_for(self, msg: m.StartRanks) -> StoreSpec:
        """Where this start's ranks meet: a FileStore in a private folder when the whole
        mesh is on this host, else rank 0's TCPStore on the socket bound for it."""
        from monarch_kernel.rank.dist import free_port

        if msg.dist.backend == "none":
            return StoreSpec(port=0)
        if len(msg.ranks) == msg.dist.world_size:
            folder = msg.shm_dir or self._private_folder()
            path = os.path.join(folder, f"store-{secrets.token_hex(8)}")
            return StoreSpec(port=free_port(msg.dist.master_addr), file=path)
        if not any(spec.rank == 0 for spec in msg.ranks):
            return StoreSpec(port=msg.master_port)
        if self._store_sock is None:
            self.bind_store(msg.dist.master_addr)
        assert self._store_sock is not None
        return StoreSpec(port=int(self._store_sock.getsockname()[1]), listen_fd=self._store_sock.fileno())

    def _private_folder(self) -> str:
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="monarch-store-")  # 0700
        return self._folder

    def _close_store_socket(self) -> None:
        if self._store_sock is not None:
            self._store_sock.close()
            self._store_sock = None

    def close(self) -> None:
        """Let go of what the ranks shared: the store's socket and the private folder."""
        self._close_store_socket()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    async def start(self, msg: m.StartRanks) -> tuple[m.RankInfo, ...]:
        """Stop the ranks running, then fork and await the ones `msg` asks for (raises if they fail).

        Starts run one at a time: a second StartRanks waits for the first, then replaces its ranks.
        """
        async with self._starting:
            return await self._start(msg)

    async def _start(self, msg: m.StartRanks) -> tuple[m.RankInfo, ...]:
        await self.stop_all(1.0)
        await self.preloader.ready()  # forked ranks start with the preloaded modules
        self.health = msg.health
        self.local_ranks = {spec.rank for spec in msg.ranks}
        store = self._store_for(msg)
        for spec in msg.ranks:
            self.procs[spec.rank] = await fork_rank(self, spec, msg, store if spec.rank == 0 else
                                                    replace(store, listen_fd=None))
        procs = dict(self.procs)  # a rank that fails also exits, and leaves self.procs
        replies = await asyncio.wait_for(asyncio.gather(*(p.ready for p in procs.values() if p.ready)),
                                         timeout=msg.dist.timeout_s)
        for rank, reply in zip(procs, replies):
            if reply.failure is not None:
                raise RuntimeError(f"rank {rank} failed to start:\n{reply.failure.traceback or reply.failure.message}")
        gone = sorted(set(procs) - set(self.procs))
        if gone:
            raise RuntimeError(f"ranks {gone} exited right after start-up")
        self._close_store_socket()  # rank 0 holds the store's socket now; the agent lets go of it
        return tuple(m.RankInfo(r, p.pid, self.host) for r, p in sorted(procs.items()))

    async def stop_all(self, grace_s: float, *, asked: bool = True) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after grace_s.

        asked: the controller asked for it (a restart or shutdown), so their exits are
        expected; otherwise (the agent's own decision) they are reported as deaths.
        """
        for proc in list(self.procs.values()):
            proc.stopping = asked
            _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.procs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.kill_all()
        while self.procs:
            await asyncio.sleep(0.01)

    def kill_all(self) -> None:
        """SIGKILL every rank's process group now."""
        for proc in list(self.procs.values()):
            _kill_group(proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------ the launcher's callbacks
    def on_rank_message(self, rank: int, msg: Any) -> None:
        """A rank's message (its start-up reply is kept here; the rest go to the listener)."""
        proc = self.procs.get(rank)
        if isinstance(msg, m.Result) and msg.req_id == 0 and proc is not None and proc.ready is not None:
            if not proc.ready.done():
                proc.ready.set_result(msg)
            return
        self.listener.on_rank_message(rank, msg)

    def on_rank_fd_output(self, rank: int, stream: str, data: bytes, total: int | None) -> None:
        """Bytes a rank wrote to its real fd 1/2 (C extensions, crashes; the launcher keeps its stderr's tail)."""
        self.listener.on_rank_fd_output(rank, stream, data, total)

    def remember_stderr(self, rank: int, text: str) -> None:
        """Keep the tail of what a rank wrote to stderr, for its crash report."""
        proc = self.procs.get(rank)
        if proc is not None:
            proc.stderr_tail.write("stderr", text)

    def on_rank_exit(self, rank: int) -> None:
        """A rank's process ended: reap it, release its descriptors, tell the listener."""
        proc = self.procs.get(rank)
        if proc is None:
            return
        drain_outputs(self, proc)  # its last lines, while it is known here (they go into its stderr tail: the report)
        del self.procs[rank]
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.pidfd)
        os.close(proc.pidfd)
        # unregister before closing: a stale registration would swallow the next rank's
        # heartbeats (its socket may reuse the same descriptor number)
        loop.remove_reader(proc.hb_sock.fileno())
        proc.hb_sock.close()
        _kill_group(proc.pid, signal.SIGKILL)  # anything the rank left behind (its zombie pins the group id)
        _, status = os.waitpid(proc.pid, 0)
        drain_outputs(self, proc)  # (and what its leftover children wrote until they were killed)
        code = os.waitstatus_to_exitcode(status)
        exit_code, sig = (code, None) if code >= 0 else (None, signal.Signals(-code).name)
        if proc.conn is not None:
            proc.conn.close()
        if proc.ready is not None and not proc.ready.done():
            proc.ready.set_exception(RuntimeError(
                f"rank {rank} exited during start-up ({exit_text(exit_code, sig)})" + tail_text(proc)))
        self.listener.on_rank_gone(rank, proc, exit_code, sig)

    def on_pong(self, rank: int) -> None:
        """A heartbeat answer arrived from a rank (with what its actors are doing)."""
        proc = self.procs.get(rank)
        if proc is None:
            return
        try:
            data = proc.hb_sock.recv(4096)
        except OSError:
            return
        answers = data.split(b"\n")
        if len(answers) > 1:  # the latest complete answer says what the rank is doing
            activity, _, rest = answers[-2].lstrip(b".").decode("utf-8", "replace").partition("\t")
            collective, _, request = rest.partition("\t")
            went_idle = bool(proc.activity) and not activity
            proc.activity, proc.collective = activity, collective
            req_id, _, label = request.partition(":")
            proc.running = int(req_id) if req_id.isdigit() else None
            if req_id.isdigit():
                proc.requests[int(req_id)] = label  # (what a persistent mesh's held output is named by)
                if len(proc.requests) > 64:
                    del proc.requests[next(iter(proc.requests))]
            if went_idle:
                self.listener.on_went_idle()
        proc.last_pong = time.monotonic()
        if not proc.responsive:
            proc.responsive = True
            self.listener.on_rank_health(rank, True)

    # ------------------------------------------------------------ watching
    def ping(self, now: float) -> None:
        """Ping every rank; report those silent for longer than unresponsive_after_s."""
        for rank, proc in list(self.procs.items()):
            try:
                proc.hb_sock.send(b".")
            except OSError:
                continue
            if proc.responsive and now - proc.last_pong > self.health.unresponsive_after_s:
                proc.responsive = False
                self.listener.on_rank_health(rank, False)

    def loads(self) -> list[Any]:
        """Each rank's CPU, memory and GPU load now."""
        return self._sampler.sample({r: (p.pid, p.spec.local_rank) for r, p in self.procs.items()},
                                    {r: p.activity for r, p in self.procs.items()},
                                    {r: p.collective for r, p in self.procs.items()})


def tail_text(proc: RankProcess) -> str:
    """A rank's last stderr lines, for a report."""
    tail = proc.stderr_tail.texts()
    return ("\nlast stderr lines:\n  " + "\n  ".join(tail)) if tail else ""


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        _kill(pid, signum)
