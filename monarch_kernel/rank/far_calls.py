"""Calls between ranks of two meshes on different hosts, over one authenticated TCP link per pair of ranks.

The first call from a rank to another mesh's ranks goes the long way (its agent, the controller's bridge,
the other mesh's agent: four SSH-channel crossings per round trip). When the called mesh runs on remote
hosts, the controller then has its ranks listen on their hosts' addresses (`ListenForCalls`) and tells
the caller where (`DirectRoute.far`). The caller's loop opens a link to each called rank, and later calls
and their replies take that link: one TCP round trip.

A link is the relay link's (`wire/relay_link.py`): an ephemeral key exchange that both ends authenticate
with a key made for the called mesh, handed out over the controller's own encrypted channels (never on a
command line, never sent on the link), then every frame encrypted and authenticated. A peer that fails the
handshake is closed before anything it sent is read as a message; connections still in their handshake are
bounded in number, in all and per source address (`wire/handshake_gate.py`); and a call that names
shared-memory files (of the called host) is refused.
Both ends run on the rank's event loop (`rank-loop`); other threads hand frames to it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.addresses import numeric_address
from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.wire.calls import death_reply
from monarch_kernel.wire.handshake_gate import ACCEPT_BACKLOG, HandshakeGate
from monarch_kernel.wire.messages import (
    ActorCall,
    ActorReply,
    CancelCall,
    DirectRoute,
    ListenForCalls,
    ListeningForCalls,
)
from monarch_kernel.wire.relay_link import DOWN, UP, RelayLink, RelayRefused, handshake_as_child, handshake_as_parent, no_delay
from monarch_kernel.wire.serialization import carries_shm_refs
from monarch_kernel.wire.transport import encode

CONNECT_TIMEOUT_S = 5.0


class LoopSender:
    """Sends on a link that only its loop may write to, from any thread, in the order the sends were made."""

    def __init__(self, loop: asyncio.AbstractEventLoop, link: RelayLink):
        self._loop = loop
        self._link = link
        self._lock = threading.Lock()
        self._queued: list[list[Any]] = []

    def send(self, msg: Any) -> None:
        """Queue one message and have the loop write it (now, if this is the loop's thread)."""
        chunks = encode(msg)
        with self._lock:
            if self._link.closed:
                raise ConnectionClosed("the link closed")
            self._queued.append(chunks)
            first = len(self._queued) == 1
        if _on_loop(self._loop):
            self._write()
        elif first:
            self._loop.call_soon_threadsafe(self._write)

    def _write(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
        for chunks in queued:
            self._link.send_chunks(chunks)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class CallListener:
    """The called rank's end: listens on its host's address; each link that proves the key brings calls."""

    def __init__(self, rank: int, serve: Callable[[Any, Callable[[Any], None]], None],
                 tell: Callable[[Any], None]):
        self._rank = rank
        self._serve = serve  # (a call or a cancel, how to answer it)
        self._tell = tell  # to the controller
        self._server: asyncio.Server | None = None
        self._key = b""
        self._gate = HandshakeGate(f"monarch_kernel: rank {rank}'s call listener",
                                   lambda text: print(text, file=sys.__stderr__, flush=True))

    @property
    def refused(self) -> int:
        """Connections that did not prove the key (dropped past the gate's caps included)."""
        return self._gate.refused

    async def listen(self, msg: ListenForCalls) -> None:
        """Listen (once: a second ask, from a kernel that attached later, gets the same port, and links
        from now on must prove its key), and say where."""
        self._key = msg.key
        if self._server is None:
            try:
                address = numeric_address(msg.address)
                self._server = await asyncio.start_server(self._accept, host=address, port=0, backlog=ACCEPT_BACKLOG)
            except OSError as exc:
                self._tell(ListeningForCalls(self._rank, msg.address, 0, f"cannot listen on {msg.address}: {exc}"))
                return
        host, port = self._server.sockets[0].getsockname()[:2]
        self._tell(ListeningForCalls(self._rank, host, port))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        token = self._gate.admit(writer)
        try:
            _, session = await handshake_as_parent(reader, writer, self._key)
        except RelayRefused as exc:
            self._gate.refuse(token, str(exc))
            return
        self._gate.done(token)
        no_delay(writer)
        sender: list[LoopSender] = []

        def on_message(msg: Any) -> None:
            if isinstance(msg, ActorCall) and carries_shm_refs(msg):
                link.close(RelayRefused("a call from another host named shared-memory files of this one"))
            elif isinstance(msg, ActorCall | CancelCall):
                self._serve(msg, sender[0].send)

        link = RelayLink(reader, writer, session, DOWN, on_message, lambda exc: None)
        sender.append(LoopSender(asyncio.get_running_loop(), link))


class FarLane:
    """The caller's end of a link to one rank on another host (see the module's note)."""

    def __init__(self, rank: int, deliver: Callable[[ActorReply], None], caller: int):
        self.rank = rank
        self._deliver = deliver
        self._caller = caller
        self._lock = threading.Lock()
        self._owed: set[int] = set()
        self._sender: LoopSender | None = None
        self.closed = False

    @property
    def ready(self) -> bool:
        """Whether the link is up (until then, and after it closed, calls go the long way)."""
        return self._sender is not None and not self.closed

    async def connect(self, address: str, port: int, key: bytes, index: int) -> None:
        """Open the link and prove the key; a failure leaves the lane closed (the long way stays)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
            session = await handshake_as_child(reader, writer, key, index)
        except (OSError, TimeoutError, RelayRefused):
            self.closed = True
            return
        no_delay(writer)
        link = RelayLink(reader, writer, session, UP, self._on_reply, self._on_close)
        self._sender = LoopSender(asyncio.get_running_loop(), link)

    def send(self, msg: ActorCall | CancelCall) -> None:
        """Send a call (or its cancel); raises ConnectionClosed if the link is gone."""
        sender = self._sender
        if isinstance(msg, ActorCall) and not msg.to_port:
            with self._lock:
                if self.closed or sender is None:
                    raise ConnectionClosed("the link closed")
                self._owed.add(msg.call_id)
        if sender is None:
            raise ConnectionClosed("the link is not open")
        try:
            sender.send(msg)
        except ConnectionClosed:
            with self._lock:
                self._owed.discard(getattr(msg, "call_id", -1))
            raise

    def _on_reply(self, msg: Any) -> None:
        if isinstance(msg, ActorReply) and not msg.to_port:
            with self._lock:
                self._owed.discard(msg.call_id)
            self._deliver(msg)

    def _on_close(self, exc: Exception | None) -> None:
        with self._lock:
            self.closed = True
            owed, self._owed = self._owed, set()
        for call_id in owed:  # the rank, its host or the link went away before answering
            why = f"rank {self.rank} of the called mesh went away before answering (its link closed"
            self._deliver(death_reply(self._caller, call_id, self.rank, f"{why}: {exc})" if exc else f"{why})"))


class FarLinks:
    """A caller's links to the ranks of meshes on other hosts, opened when first called (see the module's
    note): each route is (the mesh's key, where each of its ranks listens)."""

    def __init__(self, deliver: Callable[[ActorReply], None], caller: Callable[[], int]):
        self._deliver = deliver
        self._caller = caller  # this process's caller id on links
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[bytes, dict[int, tuple[str, int]]]] = {}
        self._lanes: dict[tuple[str, int], FarLane] = {}
        self.loop: asyncio.AbstractEventLoop | None = None  # the rank's loop, where the links run

    def learn(self, msg: DirectRoute) -> None:
        """Where mesh `msg.mesh`'s ranks listen, and its key (links made under an older route are dropped)."""
        with self._lock:
            self._routes[msg.mesh] = (msg.key, {rank: (address, port) for rank, address, port in msg.far})
            for lane_key in [k for k in self._lanes if k[0] == msg.mesh]:
                del self._lanes[lane_key]

    def knows(self, mesh: str) -> bool:
        """Whether there is a route to mesh `mesh` on other hosts."""
        return mesh in self._routes

    def lanes(self, mesh: str, ranks: tuple[int, ...]) -> list[FarLane] | None:
        """The open links to these ranks of `mesh`; None if one is not open yet (it is being opened: the
        long way until then) or cannot be (a link failed: the long way from now on, for the whole mesh)."""
        lanes: list[FarLane] = []
        with self._lock:
            route = self._routes.get(mesh)
            if route is None or self.loop is None:
                return None
            for rank in ranks:
                lane = self._lanes.get((mesh, rank))
                if lane is None:
                    if rank not in route[1]:
                        return None
                    lane = self._lanes[(mesh, rank)] = FarLane(rank, self._deliver, self._caller())
                    connect_far(self.loop, lane, *route[1][rank], route[0], 0)
                elif lane.closed:
                    self._routes.pop(mesh, None)
                    return None
                lanes.append(lane)
        return lanes if all(lane.ready for lane in lanes) else None


_connecting: set[asyncio.Task[None]] = set()


def connect_far(loop: asyncio.AbstractEventLoop, lane: FarLane, address: str, port: int, key: bytes,
                index: int) -> None:
    """Start opening `lane` on the rank's loop (from any thread)."""

    def start() -> None:
        task = loop.create_task(lane.connect(address, port, key, index))
        _connecting.add(task)
        task.add_done_callback(_connecting.discard)

    loop.call_soon_threadsafe(start)

