"""`PortForwarder` (Monarch's `monarch.job.PortForwarder`): TCP port forwards between two process meshes.

    forwarder = this_proc().spawn("port_forwarder", PortForwarder)
    await forwarder.forward.call_one(dst_procs, 8000, src_procs, "127.0.0.1:9000")
    ...                                   # connect to 127.0.0.1:9000 on each src proc
    await forwarder.stop()                # every forward it made closes

Each point of `src_procs` listens on its address; a connection there is relayed to
127.0.0.1:`dst_port` on the point of `dst_procs` with the same coordinates. Both may be given as
functions of the point. The bytes travel between the two processes as messages on actor ports (a
`Channel` each way), so the forward works wherever the two meshes' actors can call each other.
Written on this package's Monarch API only: the listener and connector are actors spawned on the two
meshes by the forwarder, which owns them and stops them when it stops.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.monarch.actor import Actor, Channel, Point, Port, PortReceiver, ProcMesh, current_rank, endpoint

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024
CLOSE_WAIT_S = 1.0

PortSpec = int | Callable[[Point], int]
AddressSpec = str | Callable[[Point], str]


@dataclass(frozen=True)
class _Bytes:
    """Bytes read from one end's socket."""

    data: bytes


@dataclass(frozen=True)
class _Finished:
    """The sending end's socket reached end of file (a half close)."""


@dataclass(frozen=True)
class _Broken:
    """The sending end's connection failed or was torn down: abort this end too."""


def checked_port(what: str, port: object) -> int:
    """A TCP port number (ValueError naming `what` otherwise)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{what} must be an integer from 1 through 65535, not {port!r}")
    return port


def split_address(address: object) -> tuple[str, int]:
    """`"host:port"` (IPv6 in brackets) as (host, port); ValueError saying what is wrong."""
    if not isinstance(address, str):
        raise ValueError(f"src_address must be a string 'address:port', not {address!r}")
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        raise ValueError(f"src_address {address!r} is not in 'address:port' form")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"src_address {address!r}: the port is not an integer") from None
    return host.removeprefix("[").removesuffix("]"), checked_port("src_address port", number)


def _for_point(spec: Any, point: Point) -> Any:
    return spec(point) if callable(spec) else spec


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_WAIT_S)
    except (OSError, TimeoutError):
        writer.transport.abort()


async def _pump_out(reader: asyncio.StreamReader, peer: Port[Any]) -> None:
    """Socket -> the other end, until end of file."""
    while chunk := await reader.read(CHUNK):
        peer.send(_Bytes(chunk))
        await asyncio.sleep(0)  # (a read from a full buffer does not yield: let the other direction and stops run)
    peer.send(_Finished())


async def _pump_in(inbox: PortReceiver[Any], writer: asyncio.StreamWriter, peer_finished: asyncio.Event) -> None:
    """The other end -> socket. After it finished (a half close here) only a break can follow, which is
    still watched for: this runs until the relay ends, or raises when the other end broke off."""
    while True:
        message = await inbox.recv()
        if isinstance(message, _Bytes) and not peer_finished.is_set():
            writer.write(message.data)
            await writer.drain()  # (a slow reader here holds this end's writes back)
        elif isinstance(message, _Finished) and not peer_finished.is_set():
            if writer.can_write_eof():
                writer.write_eof()
                await writer.drain()
            peer_finished.set()
        else:
            raise ConnectionAbortedError("the other end of the forward broke off")


async def _both_finished(out: asyncio.Task[None], peer_finished: asyncio.Event) -> None:
    await out  # (raises if this end's socket failed)
    await peer_finished.wait()


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Port[Any],
                inbox: PortReceiver[Any]) -> None:
    """Carry one connection both ways until both sides finished; on a failure of either side, or a
    cancellation, abort both."""
    peer_finished = asyncio.Event()
    out = asyncio.create_task(_pump_out(reader, peer))
    into = asyncio.create_task(_pump_in(inbox, writer, peer_finished))
    finished = asyncio.create_task(_both_finished(out, peer_finished))
    tasks = (out, into, finished)
    try:
        done, _ = await asyncio.wait((into, finished), return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    except asyncio.CancelledError:
        _break(peer, writer)
        raise
    except Exception:  # noqa: BLE001 - a socket error, or the other end broke off: this connection ends
        _break(peer, writer)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(writer)


def _break(peer: Port[Any], writer: asyncio.StreamWriter) -> None:
    """Tell the other end this connection broke, and abort ours."""
    try:
        peer.send(_Broken())
    except Exception:  # noqa: BLE001 - the other end may be gone already
        pass
    writer.transport.abort()


class _Relays:
    """The connections one actor carries, cancelled together when it stops."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()

    def start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Port[Any],
              inbox: PortReceiver[Any]) -> None:
        task = asyncio.create_task(relay(reader, writer, peer, inbox))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def cancel_all(self) -> None:
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


class ForwardConnector(Actor):
    """On a destination process: connects each forwarded connection to 127.0.0.1:port."""

    def __init__(self) -> None:
        self._port: int | None = None
        self._relays = _Relays()

    @endpoint
    async def configure(self, port: PortSpec) -> None:
        """The local port this point connects to (a number, or a function of the point)."""
        self._port = checked_port("dst_port", _for_point(port, current_rank()))

    @endpoint
    async def connect(self, to_source: Port[Any]) -> Port[Any]:
        """Open the local connection; the port the source sends this connection's bytes to."""
        if self._port is None:
            raise RuntimeError("the forward's destination was not configured")
        reader, writer = await asyncio.open_connection(LOOPBACK, self._port)
        to_here: Port[Any]
        inbox: PortReceiver[Any]
        to_here, inbox = Channel.open()
        self._relays.start(reader, writer, to_source, inbox)
        return to_here

    async def __cleanup__(self, exc: Exception | None) -> None:
        await self._relays.cancel_all()


class ForwardListener(Actor):
    """On a source process: listens on its address and forwards each connection to its destination point."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self._connector: Any = None
        self._relays = _Relays()

    @endpoint
    async def listen(self, connectors: Any, address: AddressSpec) -> None:
        """Listen on this point's address, forwarding to the connector at the same point of `connectors`."""
        point = current_rank()
        self._connector = connectors.slice(**dict(point))
        host, port = split_address(_for_point(address, point))
        self._server = await asyncio.start_server(self._accepted, host, port, reuse_port=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        to_here: Port[Any]
        inbox: PortReceiver[Any]
        try:
            to_here, inbox = Channel.open()
            to_destination = await self._connector.connect.call_one(to_here)
        except Exception:  # noqa: BLE001 - the destination refused: this connection closes, the listener stays
            writer.transport.abort()
            return
        self._relays.start(reader, writer, to_destination, inbox)

    async def __cleanup__(self, exc: Exception | None) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        await self._relays.cancel_all()


class PortForwarder(Actor):
    """Owns point-to-point TCP forwards between process meshes; stopping it closes every one it made."""

    def __init__(self) -> None:
        self._owned: list[Any] = []

    @endpoint
    async def forward(self, dst_proc_mesh: ProcMesh, dst_port: PortSpec, src_proc_mesh: ProcMesh,
                      src_address: AddressSpec) -> None:
        """Forward `src_address` on each point of `src_proc_mesh` to 127.0.0.1:`dst_port` on the same point of
        `dst_proc_mesh` (the meshes must have the same shape; either value may be a function of the point)."""
        if dst_proc_mesh.extent != src_proc_mesh.extent:
            raise ValueError("destination and source process meshes must have the same shape: "
                             f"{dst_proc_mesh.extent} != {src_proc_mesh.extent}")
        if not callable(dst_port):
            checked_port("dst_port", dst_port)
        if not callable(src_address):
            split_address(src_address)
        tag = uuid.uuid4().hex[:12]
        made: list[Any] = []
        try:
            connectors = dst_proc_mesh.spawn(f"port_forward_connector_{tag}", ForwardConnector)
            made.append(connectors)
            listeners = src_proc_mesh.spawn(f"port_forward_listener_{tag}", ForwardListener)
            made.append(listeners)
            await connectors.configure.call(dst_port)
            await listeners.listen.call(connectors, src_address)
        except Exception:
            await _stop_all(made)  # (a listener already listening on one point closes again)
            raise
        self._owned.extend(made)

    async def __cleanup__(self, exc: Exception | None) -> None:
        owned, self._owned = self._owned, []
        await _stop_all(owned)


async def _stop_all(meshes: list[Any]) -> None:
    results = await asyncio.gather(*(_stopped(m) for m in meshes), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


async def _stopped(mesh: Any) -> None:
    stopping = mesh.stop()
    if hasattr(stopping, "__await__"):
        await stopping
