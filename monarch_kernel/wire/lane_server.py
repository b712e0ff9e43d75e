"""The rank's end of its direct lanes: listen, accept our own user only, serve frames.

See `lanes` for what a lane is.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.wire.lanes import peer_is_us, read_available
from monarch_kernel.wire.transport import FrameProtocol, advance, byte_views, encode


def listen_lane(path: str) -> socket.socket:
    """Listen on a lane path (owner-only), non-blocking."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(16)
    sock.setblocking(False)
    return sock


def accept_lane(listener: socket.socket) -> socket.socket | None:
    """Accept one peer if it runs as our own user; None otherwise (or if none waits)."""
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    if not peer_is_us(conn):
        conn.close()
        return None
    return conn


class LaneServer:
    """The rank's end of one lane, served on the rank's event loop.

    Frames are read straight off the socket when it is readable; replies made while a
    batch of calls is being handled go out together in one write at the end of it.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None]):
        sock.setblocking(False)
        self.sock = sock
        self.closed = False
        self._loop = loop
        self._reader = FrameProtocol(on_message, self._lost)
        self._out: list[memoryview] = []
        self._in_batch = False
        self._waiting_to_write = False
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, msg: Any) -> None:
        """Send a reply (now, or with the rest of the batch being handled)."""
        if self.closed:
            raise ConnectionClosed("the lane is closed")
        self._out.extend(byte_views(encode(msg)))
        if not self._in_batch:
            self._flush()

    def _readable(self) -> None:
        self._in_batch = True
        try:
            read_available(self.sock, self._reader, self._lost, lambda: self.closed)
        finally:
            self._in_batch = False
        self._flush()

    def _flush(self) -> None:
        while self._out and not self.closed:
            try:
                advance(self._out, self.sock.sendmsg(self._out[:512]))
            except (BlockingIOError, InterruptedError):
                if not self._waiting_to_write:  # the caller is not reading yet: finish when it does
                    self._waiting_to_write = True
                    self._loop.add_writer(self.sock.fileno(), self._writable)
                return
            except OSError as exc:
                self._lost(exc)

    def _writable(self) -> None:
        self._waiting_to_write = False
        self._loop.remove_writer(self.sock.fileno())
        self._flush()

    def _lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._out.clear()
        self._loop.remove_reader(self.sock.fileno())
        if self._waiting_to_write:
            self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
