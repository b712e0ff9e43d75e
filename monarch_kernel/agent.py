"""The host agent: one per host, it forks, supervises and fans out to that host's ranks.

The agent imports torch once and forks every rank from itself, so ranks start warm and
a restart costs a fork, not an interpreter start. It routes each request to its local
ranks with one encoding, gathers their replies into one message, watches each rank
(exit via pidfd, heartbeats for frozen ones), keeps the tail of each rank's stderr for
crash reports, and kills every rank's process group when the controller goes away.

Run as `python -m monarch_kernel.agent --fd N --host NAME` with the controller's end of
a socketpair inherited as fd N (or over SSH, on stdin/stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from . import messages as m
from .calls import CallTracker, death_reply
from .launcher import RankProcess, fork_rank
from .load import LoadSampler
from .transport import AsyncConnection, encode

HEARTBEAT_INTERVAL_S = 0.5
UNRESPONSIVE_AFTER_S = 2.5
CONTROLLER_SILENCE_S = 6.0
LOAD_INTERVAL_S = 1.0  # the controller pings every second; silence means it is gone


class HostAgent:
    """Supervises this host's ranks on behalf of one controller connection."""

    def __init__(self, host: str):
        self.host = host
        self.ranks: dict[int, RankProcess] = {}
        self.pending: dict[int, tuple[set[int], list[m.Result]]] = {}
        self.controller: AsyncConnection | None = None
        self.done = asyncio.get_running_loop().create_future()
        self._store_sock: socket.socket | None = None
        self.last_heard = time.monotonic()
        self._outbox: list[Any] = []
        self.local_ranks: set[int] = set()  # every rank of this host, alive or not
        self.calls = CallTracker()  # actor calls routed to this host's ranks
        self._sampler = LoadSampler()
        self._last_load = 0.0

    # ------------------------------------------------------------ controller side
    def on_controller_message(self, msg: Any) -> None:
        """Dispatch one message from the controller."""
        self.last_heard = time.monotonic()
        if isinstance(msg, m.ToRanks):
            self._fan_out(msg)
        elif isinstance(msg, m.SignalRanks):
            for rank in msg.ranks:
                proc = self.ranks.get(rank)
                if proc is not None:
                    _kill(proc.pid, msg.signum)
        elif isinstance(msg, m.ActorCall):
            self._deliver_call(msg, msg.ranks)
        elif isinstance(msg, m.ActorReply):
            self._route_reply(msg)
        elif isinstance(msg, (m.CancelCall, m.InputReply)):
            self._deliver_to_ranks(msg, msg.ranks)
        elif isinstance(msg, m.Ping):
            self._to_controller(m.Pong(msg.seq))
        elif isinstance(msg, m.BindStore):
            self._bind_store(msg.addr)
        elif isinstance(msg, m.StartRanks):
            asyncio.get_running_loop().create_task(self._start(msg))
        elif isinstance(msg, m.Shutdown):
            asyncio.get_running_loop().create_task(self.shutdown("the controller asked"))

    def on_controller_closed(self, exc: Exception | None) -> None:
        """The controller is gone (kernel died, SSH dropped): take every rank down."""
        asyncio.get_running_loop().create_task(self.shutdown(f"the controller connection closed ({exc})"))

    def _to_controller(self, msg: Any) -> None:
        if self.controller is None:
            self._outbox.append(msg)  # the connection is still being set up
        elif not self.controller.closed:
            self.controller.send(msg)

    def connected(self, conn: AsyncConnection) -> None:
        """The controller connection is ready: send what was queued meanwhile."""
        self.controller = conn
        for msg in self._outbox:
            conn.send(msg)
        self._outbox.clear()

    def _fan_out(self, msg: m.ToRanks) -> None:
        req_id = msg.body.req_id
        chunks = encode(msg.body)
        waiting: set[int] = set()
        for rank in msg.ranks:
            proc = self.ranks.get(rank)
            if proc is None or proc.conn is None or proc.conn.closed:
                continue  # the controller already knows it is dead
            proc.conn.send_chunks(chunks)
            waiting.add(rank)
        self.pending[req_id] = (waiting, [])
        self._maybe_gathered(req_id)

    def _maybe_gathered(self, req_id: int) -> None:
        waiting, results = self.pending[req_id]
        if not waiting:
            del self.pending[req_id]
            self._to_controller(m.Gathered(req_id, tuple(results)))

    # ------------------------------------------------------------ rank side
    def on_rank_message(self, rank: int, msg: Any) -> None:
        """Route one message from a rank."""
        if isinstance(msg, m.Result):
            proc = self.ranks.get(rank)
            if msg.req_id == 0 and proc is not None and proc.ready is not None:
                if not proc.ready.done():
                    proc.ready.set_result(msg)
                return
            entry = self.pending.get(msg.req_id)
            if entry is not None:
                entry[0].discard(rank)
                entry[1].append(msg)
                self._maybe_gathered(msg.req_id)
            return
        if isinstance(msg, m.ActorReply):
            if self.calls.answered(msg.caller, msg.call_id, rank):
                self._route_reply(msg)
            return
        if isinstance(msg, (m.ActorCall, m.CancelCall)):
            self._route_from_rank(msg)
            return
        if isinstance(msg, m.Output) and msg.stream == "stderr":
            self._remember_stderr(rank, msg.text)
        self._to_controller(msg)

    # ------------------------------------------------------------ actor call routing
    def _route_from_rank(self, msg: m.ActorCall | m.CancelCall) -> None:
        """A rank's own call: ranks of this host get it directly, the rest via the controller."""
        here = tuple(r for r in msg.ranks if r in self.local_ranks)
        away = tuple(r for r in msg.ranks if r not in self.local_ranks)
        if here:
            if isinstance(msg, m.ActorCall):
                self._deliver_call(msg, here)
            else:
                self._deliver_to_ranks(msg, here)
        if away:
            self._to_controller(replace(msg, ranks=away))

    def _deliver_call(self, msg: m.ActorCall, ranks: tuple[int, ...]) -> None:
        chunks = encode(msg)
        for rank in ranks:
            proc = self.ranks.get(rank)
            if proc is None or proc.conn is None or proc.conn.closed:
                self._route_reply(death_reply(msg.caller, msg.call_id, rank, f"rank {rank} on {self.host} is not running"))
                continue
            self.calls.add(msg.caller, msg.call_id, (rank,))
            proc.conn.send_chunks(chunks)

    def _deliver_to_ranks(self, msg: Any, ranks: tuple[int, ...]) -> None:
        chunks = encode(msg)
        for rank in ranks:
            proc = self.ranks.get(rank)
            if proc is not None and proc.conn is not None and not proc.conn.closed:
                proc.conn.send_chunks(chunks)

    def _route_reply(self, reply: m.ActorReply) -> None:
        """To the calling rank if it lives here, else to the controller."""
        if reply.caller in self.local_ranks:
            proc = self.ranks.get(reply.caller)
            if proc is not None and proc.conn is not None and not proc.conn.closed:
                proc.conn.send(reply)
        else:
            self._to_controller(reply)

    def _remember_stderr(self, rank: int, text: str) -> None:
        proc = self.ranks.get(rank)
        if proc is not None:
            proc.stderr_tail.write("stderr", text)

    def on_rank_fd_output(self, rank: int, stream: str, data: bytes) -> None:
        """Text a rank wrote to its real fd 1/2 (C extensions, crashes)."""
        text = data.decode("utf-8", "replace")
        if stream == "stderr":
            self._remember_stderr(rank, text)
        self._to_controller(m.Output(rank, None, stream, text))

    def on_rank_exit(self, rank: int) -> None:
        """A rank's process ended: reap it, tell the controller, release its waits."""
        proc = self.ranks.pop(rank, None)
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.pidfd)
        os.close(proc.pidfd)
        # unregister before closing: a stale registration would swallow the next rank's
        # heartbeats (its socket may reuse the same descriptor number)
        loop.remove_reader(proc.hb_sock.fileno())
        proc.hb_sock.close()
        _, status = os.waitpid(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        exit_code, sig = (code, None) if code >= 0 else (None, signal.Signals(-code).name)
        _kill_group(proc.pid, signal.SIGKILL)  # anything the rank left behind
        if proc.conn is not None:
            proc.conn.close()
        if proc.ready is not None and not proc.ready.done():
            proc.ready.set_exception(RuntimeError(
                f"rank {rank} exited during start-up ({_status_text(exit_code, sig)})"
                + _tail_text(proc.stderr_tail.texts())))
        why = (f"rank {rank} on {self.host} (pid {proc.pid}) died ({_status_text(exit_code, sig)}) "
               f"before answering" + _tail_text(proc.stderr_tail.texts()))
        for caller, call_id in self.calls.owed_by(rank):
            if self.calls.answered(caller, call_id, rank):
                self._route_reply(death_reply(caller, call_id, rank, why))
        self._to_controller(m.RankExited(rank, proc.pid, exit_code, sig, tuple(proc.stderr_tail.texts()), proc.stopping))
        for req_id in list(self.pending):
            self.pending[req_id][0].discard(rank)
            self._maybe_gathered(req_id)

    # ------------------------------------------------------------ lifecycle
    async def _start(self, msg: m.StartRanks) -> None:
        try:
            await self._stop_ranks(1.0)
            infos = await self._spawn_all(msg)
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            await self._stop_ranks(0.5)
            self._to_controller(m.RanksFailed(f"{self.host}: {exc}"))
            return
        self._to_controller(m.RanksStarted(infos))

    def _bind_store(self, addr: str) -> None:
        from .dist import bind_store_socket

        if self._store_sock is not None:
            self._store_sock.close()
        try:
            self._store_sock = bind_store_socket(addr)
        except OSError as exc:
            self._to_controller(m.RanksFailed(
                f"{self.host}: cannot listen on MASTER_ADDR {addr} for the rendezvous store ({exc}); "
                "pass an address of this host (master_addr=...)"))
            return
        self._to_controller(m.StoreBound(self._store_sock.getsockname()[1]))

    async def _spawn_all(self, msg: m.StartRanks) -> tuple[m.RankInfo, ...]:
        self.local_ranks = {spec.rank for spec in msg.ranks}
        port = msg.master_port
        store_fd = None
        if any(spec.rank == 0 for spec in msg.ranks) and msg.dist.backend != "none":
            if self._store_sock is None:
                self._bind_store(msg.dist.master_addr)
            store_fd, port = self._store_sock.fileno(), self._store_sock.getsockname()[1]
        for spec in msg.ranks:
            proc = await fork_rank(self, spec, msg, store_fd if spec.rank == 0 else None, port)
            self.ranks[spec.rank] = proc
        procs = dict(self.ranks)  # a rank that fails also exits, and leaves self.ranks
        replies = await asyncio.wait_for(
            asyncio.gather(*(p.ready for p in procs.values())), timeout=msg.dist.timeout_s
        )
        for rank, reply in zip(procs, replies):
            if reply.failure is not None:
                raise RuntimeError(f"rank {rank} failed to start:\n"
                                   f"{reply.failure.traceback or reply.failure.message}")
        gone = sorted(set(procs) - set(self.ranks))
        if gone:
            raise RuntimeError(f"ranks {gone} exited right after start-up")
        return tuple(m.RankInfo(r, p.pid, self.host) for r, p in sorted(procs.items()))

    async def _stop_ranks(self, grace_s: float) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after grace_s."""
        procs = list(self.ranks.values())
        for proc in procs:
            proc.stopping = True
            _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.ranks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for proc in list(self.ranks.values()):
            _kill_group(proc.pid, signal.SIGKILL)
        while self.ranks:
            await asyncio.sleep(0.01)

    async def shutdown(self, why: str) -> None:
        """Stop all ranks and end the agent."""
        if self.done.done():
            return
        print(f"monarch_kernel agent on {self.host}: shutting down: {why}", file=sys.stderr, flush=True)
        try:
            await asyncio.wait_for(self._stop_ranks(0.5), timeout=3)
        finally:
            for proc in list(self.ranks.values()):
                _kill_group(proc.pid, signal.SIGKILL)
            if self.controller is not None:
                self.controller.close()
            if not self.done.done():
                self.done.set_result(None)

    async def heartbeat(self) -> None:
        """Ping every rank; report ranks that stop answering, and those that come back.

        Also watches the controller: if it has been silent too long (its host lost the
        network, or the kernel froze), take every rank down rather than leave them behind.
        """
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            now = time.monotonic()
            if now - self.last_heard > CONTROLLER_SILENCE_S:
                await self.shutdown(f"no message from the controller for {now - self.last_heard:.1f} s")
                return
            # loads only while the controller answers: a link gone quiet gets no traffic from
            # us, so the SSH server's own keepalive can notice it and end the session
            if now - self._last_load >= LOAD_INTERVAL_S and now - self.last_heard < 2 * LOAD_INTERVAL_S:
                self._send_loads()
            for rank, proc in list(self.ranks.items()):
                try:
                    proc.hb_sock.send(b".")
                except OSError:
                    continue
                late = now - proc.last_pong > UNRESPONSIVE_AFTER_S
                if late and proc.responsive:
                    proc.responsive = False
                    self._to_controller(m.RankHealth(rank, False))

    def _send_loads(self) -> None:
        self._last_load = time.monotonic()
        loads = self._sampler.sample({r: (p.pid, p.spec.local_rank) for r, p in self.ranks.items()},
                                     {r: p.activity for r, p in self.ranks.items()})
        if loads:
            self._to_controller(m.HostLoad(tuple(loads)))

    def on_pong(self, rank: int) -> None:
        """A heartbeat answer arrived from a rank."""
        proc = self.ranks.get(rank)
        if proc is None:
            return
        try:
            data = proc.hb_sock.recv(4096)
        except OSError:
            return
        answers = data.split(b"\n")
        if len(answers) > 1:  # the latest complete answer says what the rank is doing
            activity = answers[-2].lstrip(b".").decode("utf-8", "replace")
            went_idle = bool(proc.activity) and not activity
            proc.activity = activity
            if went_idle:
                self._send_loads()  # a rank stopped being busy: say so now, not in a second
        proc.last_pong = time.monotonic()
        if not proc.responsive:
            proc.responsive = True
            self._to_controller(m.RankHealth(rank, True))


def _status_text(exit_code: int | None, sig: str | None) -> str:
    return f"killed by {sig}" if sig else f"exit code {exit_code}"


def _tail_text(tail) -> str:
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


def _warm_imports() -> None:
    """Import what ranks need before forking them, so each starts ready."""
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError:
        pass
    import cloudpickle  # noqa: F401

    from . import capture, cell, dist, worker  # noqa: F401

    # What torch made at import lives as long as the process: out of the garbage
    # collector's sight, a full collection on a rank takes a millisecond instead of
    # stalling whatever runs then (a print, an endpoint) for ~150 ms; and forked ranks
    # share those pages instead of copying them when the collector touches them.
    gc.collect()
    gc.freeze()


async def _amain(args: argparse.Namespace) -> None:
    agent = HostAgent(args.host)
    loop = asyncio.get_running_loop()
    if args.stdio:
        # The SSH channel is our stdin/stdout: keep it on private descriptors and point
        # fds 0/1 elsewhere, so nothing a library prints can corrupt the stream.
        read_fd, write_fd = os.dup(0), os.dup(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(2, 1)
        agent.connected(await AsyncConnection.from_pipes(
            read_fd, write_fd, agent.on_controller_message, agent.on_controller_closed))
    else:
        sock = socket.socket(fileno=args.fd)
        agent.connected(await AsyncConnection.from_socket(
            sock, agent.on_controller_message, agent.on_controller_closed))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda s=sig: loop.create_task(agent.shutdown(signal.Signals(s).name)))
    beat = loop.create_task(agent.heartbeat())
    await agent.done
    beat.cancel()


def main(argv: list[str] | None = None) -> None:
    """Agent entry point."""
    parser = argparse.ArgumentParser(description="monarch_kernel host agent")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="inherited socket to the controller")
    where.add_argument("--stdio", action="store_true", help="talk to the controller on stdin/stdout (SSH)")
    parser.add_argument("--host", default=socket.gethostname())
    parser.add_argument("--cleanup", default=None, help="a folder to remove when the agent exits")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts come as messages, not signals
    from .worker import _die_with_parent

    _die_with_parent()
    _warm_imports()
    try:
        asyncio.run(_amain(args))
    finally:
        if args.cleanup:
            import shutil

            shutil.rmtree(args.cleanup, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
