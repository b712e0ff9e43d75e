"""Reaching a host's worker (`attach_to_workers`): each mesh started on it gets a new agent there.

The worker admits us (agent/worker.py has the rules): on a Unix socket it checks that we run as
its user, and we check that it does too; over TCP both ends prove the user's worker key and the
link is sealed (AES-GCM records under fresh X25519 keys).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from monarch_kernel.controller.hostspec import HostSpec, ReachedAgentHandle
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.worker_addresses import WORKER_START_WAIT_S, WorkerAddress, dial_address, not_answering
from monarch_kernel.core.worker_key import END_WORKER, START_AGENT, WorkerKeyError, request_key, worker_key
from monarch_kernel.wire.direct_auth import AuthenticationFailed, prove_controller_async
from monarch_kernel.wire.lanes import peer_credentials
from monarch_kernel.wire.link_crypto import Session
from monarch_kernel.wire.relay_link import DOWN, RelayLink

T = TypeVar("T")


@dataclass
class WorkerLink(ReachedAgentHandle):
    """The sealed TCP link to an agent a worker started for us."""

    address: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    session: Session

    def attach(self, on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]) -> Any:
        """The link, as AES-GCM records."""
        return RelayLink(self.reader, self.writer, self.session, DOWN, on_message, on_close)

    async def explain_exit(self) -> str:
        """Why it is gone, as far as we can tell from here."""
        return f"the worker at {self.address} closed the link to its agent (see the worker's own output)"

    async def wait_closed(self) -> None:
        """Until the link is closed."""
        await self.writer.wait_closed()

    def close(self) -> None:
        """Close the link: the agent ends its ranks and exits (the worker goes on)."""
        self.writer.close()


async def _retrying(address: WorkerAddress, attempt: Callable[[], Awaitable[T]], timeout: float,
                    patience: float = WORKER_START_WAIT_S) -> T:
    """`attempt()`, again while the worker refuses (it may be starting) for `patience` s; MeshStartError."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return await asyncio.wait_for(attempt(), timeout)
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if time.monotonic() > deadline:
                raise MeshStartError(not_answering(address, f"{type(exc).__name__}: {exc}")) from None
            await asyncio.sleep(0.1)
        except (OSError, TimeoutError) as exc:
            raise MeshStartError(not_answering(address, f"{type(exc).__name__}: {exc}")) from None


async def _connect_unix(address: WorkerAddress, timeout: float, patience: float = WORKER_START_WAIT_S) -> socket.socket:
    async def attempt() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, str(address.path))
        except BaseException:
            sock.close()
            raise
        return sock

    return await _retrying(address, attempt, timeout, patience)


async def _connect_tcp(address: WorkerAddress, timeout: float,
                       patience: float = WORKER_START_WAIT_S) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await _retrying(address, lambda: asyncio.open_connection(address.host, address.port, limit=1 << 22),
                           timeout, patience)


async def open_worker(spec: HostSpec) -> tuple[socket.socket | None, str, WorkerLink | None]:
    """Connect to the worker `spec` names and have it start this mesh's agent: (a Unix socket to the agent, or
    None; the host's address; the sealed TCP link, or None). MeshStartError says why not."""
    address = dial_address(spec.options["address"])
    if address.path is not None:
        sock = await _connect_unix(address, spec.connect_timeout_s)
        _, uid = peer_credentials(sock)
        if uid != os.getuid():
            sock.close()
            raise MeshStartError(f"attach failed: the socket {address.path} is served by uid {uid}, not by you: "
                                 "refusing it")
        sock.send(START_AGENT)  # (one byte into an empty socket)
        return sock, "127.0.0.1", None
    reader, writer = await _connect_tcp(address, spec.connect_timeout_s)
    try:
        writer.write(START_AGENT)
        session = await prove_controller_async(reader, writer, request_key(worker_key(), START_AGENT),
                                               timeout=spec.connect_timeout_s)
    except (AuthenticationFailed, WorkerKeyError) as exc:
        writer.close()
        raise MeshStartError(f"attach failed: the worker at {address.text} did not admit us ({exc}): both ends need "
                             "the same worker key (core/worker_key.py: copy it privately to that host)") from None
    return None, address.host, WorkerLink(address.text, reader, writer, session)


async def end_worker(text: str, timeout: float = 10.0) -> None:
    """Have the worker at `text` end (attach_to_workers' HostMesh.shutdown); one that is gone already is left."""
    address = dial_address(text)
    try:
        if address.path is not None:
            sock = await _connect_unix(address, timeout, patience=0.0)  # (one that is gone stays gone)
            with sock:
                if peer_credentials(sock)[1] == os.getuid():
                    sock.send(END_WORKER)
            return
        reader, writer = await _connect_tcp(address, timeout, patience=0.0)
    except MeshStartError:
        return
    try:
        writer.write(END_WORKER)
        await prove_controller_async(reader, writer, request_key(worker_key(), END_WORKER), timeout=timeout)
    except (AuthenticationFailed, WorkerKeyError, OSError):
        pass
    finally:
        writer.close()
