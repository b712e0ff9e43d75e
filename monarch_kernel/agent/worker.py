"""A host's worker (Monarch's `run_worker_loop_forever`): it waits for clients and starts a host agent for each.

    python -c "from monarch_kernel.monarch.actor import run_worker_loop_forever; \
               run_worker_loop_forever(address='tcp://node7:4444', ca='trust_all_connections')"

Each connection a client makes (`attach_to_workers`, then every `spawn_procs` on those hosts) is
admitted, then handed to a new host agent (`python -m monarch_kernel.agent`), which forks that
mesh's ranks as a local or SSH host's agent does; the worker goes on waiting. Admission:
- `ipc://PATH`: a Unix socket made 0600, and the peer must run as this worker's user (its uid,
  from the kernel);
- `tcp://...`: both ends prove the user's worker key (`core/worker_key.py`) over fresh X25519 keys,
  and every frame after is an AES-GCM record (`wire/direct_auth.py`, `wire/relay_link.py`). Monarch's
  `ca="trust_all_connections"` does not turn this off: a port that runs code is never open to all.
Connections in their handshake (HANDSHAKE_TIMEOUT_S each) are bounded as on our other listeners
(`wire/handshake_gate.py`: the oldest dropped past the caps, per address and in all), so a flood
cannot use up the worker or shut out the other machines. The agents die with the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
from typing import Any, cast

from monarch_kernel.core.package import PACKAGE_PARENT
from monarch_kernel.core.worker_addresses import WorkerAddress, serve_addresses
from monarch_kernel.core.worker_key import END_WORKER, START_AGENT, request_key, worker_key
from monarch_kernel.wire.direct_auth import AuthenticationFailed, check_controller_async
from monarch_kernel.wire.handshake_gate import ACCEPT_BACKLOG, HandshakeGate
from monarch_kernel.wire.lanes import peer_credentials

HANDSHAKE_TIMEOUT_S = 2.0


class _SocketStreams:
    """Exact reads and writes on a socket for the handshake, with no read-ahead: what follows the handshake
    stays in the socket for the agent."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self.received = 0  # bytes read (none: the peer only looked whether we are there)

    def get_extra_info(self, name: str) -> Any:
        """What the handshake gate asks of a connection: its peer's address."""
        if name != "peername":
            return None
        try:
            peer = self._sock.getpeername()
        except OSError:
            return None
        return peer if isinstance(peer, tuple) else ("this host",)

    def close(self) -> None:
        """Drop the connection (the gate's way): shut it down, so that a pending read ends with end-of-file.

        Never close the descriptor here: a read may be waiting on it in the event loop, and the next
        connection accepted would get the same number while the loop still holds the old one's reader
        (that connection's first read then failed, and its peer saw the connection reset). `_admit`
        closes the socket once its read has ended.
        """
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    async def readexactly(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = await self._loop.sock_recv(self._sock, count - len(data))
            if not chunk:
                raise asyncio.IncompleteReadError(data, count)
            self.received += len(chunk)
            data += chunk
        return data

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)  # (a few dozen bytes into an empty socket buffer: it never blocks)

    async def drain(self) -> None:
        return None


class Worker:
    """The accept loop of one worker (see the module's note)."""

    def __init__(self, listen_at: WorkerAddress, name: str):
        self._listen_at = listen_at
        self._name = name
        self._ended: asyncio.Event | None = None  # set by a client's END_WORKER
        self._gate = HandshakeGate(f"monarch_kernel worker {name}", _log)
        self._agents: list[subprocess.Popen[bytes]] = []

    def listen(self) -> socket.socket:
        """The listening socket (a fresh Unix socket, made 0600, or a TCP port, or the inherited fd)."""
        at = self._listen_at
        if at.path is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(at.path).st_mode):  # a worker's left-over socket (nothing else is removed)
                    os.unlink(at.path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                sock.bind(at.path)
            finally:
                os.umask(old)
        elif at.fd is not None:
            sock = socket.socket(fileno=at.fd)
        else:
            family = socket.AF_INET6 if ":" in at.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((at.host, at.port))
        sock.listen(ACCEPT_BACKLOG)
        sock.setblocking(False)
        return sock

    async def serve(self) -> None:
        """Admit clients until one ends the worker (or the process is stopped)."""
        loop = asyncio.get_running_loop()
        self._ended = asyncio.Event()
        listener = self.listen()
        key = None if self._listen_at.is_unix else worker_key()
        loop.add_signal_handler(signal.SIGCHLD, self._reap)
        print(f"monarch_kernel worker {self._name} serving (pid {os.getpid()})", file=sys.stderr, flush=True)
        accepting = loop.create_task(self._accept(listener, key))
        await self._ended.wait()
        accepting.cancel()
        listener.close()
        self._gate.close()
        if self._listen_at.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._listen_at.path)
        print(f"monarch_kernel worker {self._name}: ended by its client", file=sys.stderr, flush=True)

    async def _accept(self, listener: socket.socket, key: bytes | None) -> None:
        loop = asyncio.get_running_loop()
        admitting: set[asyncio.Task[None]] = set()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # (out of descriptors: wait for some to close rather than end the worker)
                print(f"monarch_kernel worker {self._name}: accept failed ({exc})", file=sys.stderr, flush=True)
                await asyncio.sleep(0.5)
                continue
            task = loop.create_task(self._admit(conn, key))
            admitting.add(task)
            task.add_done_callback(admitting.discard)

    async def _admit(self, conn: socket.socket, key: bytes | None) -> None:
        streams = _SocketStreams(conn)
        token = self._gate.admit(cast(Any, streams))
        try:
            conn.setblocking(False)
            session = b""
            if key is None:
                _, uid = peer_credentials(conn)
                if uid != os.getuid():
                    raise AuthenticationFailed(f"a process of uid {uid} is not this worker's user")
            request = await asyncio.wait_for(streams.readexactly(1), HANDSHAKE_TIMEOUT_S)
            if request not in (START_AGENT, END_WORKER):
                raise AuthenticationFailed(f"unknown request {request!r}")
            if key is not None:
                keys = await check_controller_async(cast(Any, streams), cast(Any, streams), request_key(key, request),
                                                    timeout=HANDSHAKE_TIMEOUT_S)
                session = keys.down + keys.up
            self._gate.done(token)
            if request == END_WORKER:
                assert self._ended is not None
                self._ended.set()
            else:
                self._start_agent(conn, session)
        except (AuthenticationFailed, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            if streams.received == 0 and not isinstance(exc, AuthenticationFailed):
                self._gate.done(token)  # a probe (attach_to_workers' `initialized`) or a port scan: nothing to say
            else:
                self._gate.refuse(token, str(exc) or type(exc).__name__)
        finally:
            conn.close()

    def _start_agent(self, conn: socket.socket, session: bytes) -> None:
        conn.setblocking(True)
        fds = [conn.fileno()]
        command = [sys.executable, "-m", "monarch_kernel.agent", "--fd", str(conn.fileno()), "--host", self._name]
        keys_read = None
        if session:  # the link's keys reach the agent on a pipe (never its command line or environment)
            keys_read, keys_write = os.pipe()
            os.write(keys_write, session)
            os.close(keys_write)
            fds.append(keys_read)
            command += ["--session-fd", str(keys_read)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        try:
            self._agents.append(subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL,
                                                 start_new_session=True, env=env, close_fds=True))
        finally:
            if keys_read is not None:
                os.close(keys_read)

    def _reap(self) -> None:
        self._agents = [agent for agent in self._agents if agent.poll() is None]


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_worker(address: str) -> None:
    """Serve as a host's worker at `address` until the process is stopped (see the module's note)."""
    listen_at, name = serve_addresses(address)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(Worker(listen_at, name.text).serve())
