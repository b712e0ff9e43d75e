"""The rank's end of its direct lanes: listen, accept our own user only, serve frames.

See `lanes` for what a lane is.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.core.interrupt_shield import shielded
from monarch_kernel.wire.lanes import peer_is_us, read_available
from monarch_kernel.wire.transport import FrameProtocol, advance, byte_views, encode

REPLY_HIGH_WATER = 256 << 20  # replies the notebook has not read before a sending thread waits
REPLY_WAIT_S = 60.0  # ... at most this long each time (then the reply is queued all the same)


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
    """The rank's end of one lane, served on one event loop: the rank's, or an async actor's own
    (`rank/actor_lanes.py`), which hands it to the rank's as the actor ends (`move_to`).

    Frames are read straight off the socket when it is readable; replies made while a
    batch of calls is being handled go out together in one write at the end of it.
    `send` may be called from any thread (a request's output is sent by the stream
    flushers); only the loop thread waits for room in the socket.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None]):
        sock.setblocking(False)
        self.sock = sock
        self.closed = False
        self._loop = loop
        self._loop_thread = threading.get_ident()  # made on the loop thread
        self._reader = FrameProtocol(on_message, self._lost)
        self._lock = threading.Lock()  # guards _out and writes to the socket
        self._out: list[memoryview] = []
        self._backlog = 0  # bytes in _out (kept as it changes: a reply's sender reads it without the lock)
        self._in_batch = False
        self._waiting_to_write = False
        self._room = threading.Condition()  # notified when replies were written (senders may wait on it)
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, msg: Any) -> None:
        """Send a reply (now, or with the rest of the batch being handled).

        A thread other than the loop's (a stream flusher, an endpoint's thread) that finds
        REPLY_HIGH_WATER bytes the notebook has not read yet waits, outside the lock, for them to
        drain (at most REPLY_WAIT_S): the rank slows down rather than piling up without end.
        """
        views = byte_views(encode(msg))
        size = sum(v.nbytes for v in views)
        with self._lock:
            if self.closed:
                raise ConnectionClosed("the lane is closed")
            self._out.extend(views)
            self._backlog += size
            if self._in_batch and threading.get_ident() == self._loop_thread:
                return
        self._flush()
        if self.closed:  # the notebook went away as we wrote: the caller sends it the other way (the agent)
            raise ConnectionClosed("the lane closed")
        if self._backlog > REPLY_HIGH_WATER and threading.get_ident() != self._loop_thread:
            self._wait_for_the_reader()

    def backlog_bytes(self) -> int:
        """Bytes of replies the notebook has not read yet."""
        return self._backlog

    def _wait_for_the_reader(self) -> None:
        deadline = time.monotonic() + REPLY_WAIT_S
        while not self.closed and time.monotonic() < deadline and self.backlog_bytes() > REPLY_HIGH_WATER:
            with self._room:
                self._room.wait(0.05)

    def end_batch(self) -> None:
        """Send what the batch has made so far, and the rest of its replies as they are made
        (a request about to run: its output and input() prompts must not wait for its end)."""
        self._in_batch = False
        if self._out:
            self._flush()

    def _readable(self) -> None:
        self._in_batch = True
        try:
            read_available(self.sock, self._reader, self._lost, lambda: self.closed)
        finally:
            self._in_batch = False
        if self._out:  # (what the batch made: often nothing, a request's reply comes from the thread that ran it)
            self._flush()

    def _flush(self) -> None:
        shielded(self._write_out)  # (a stop of the sending thread is raised once the write is counted)

    def _write_out(self) -> None:
        with self._lock:
            while self._out and not self.closed:
                try:
                    sent = self.sock.sendmsg(self._out[:512])
                    advance(self._out, sent)
                    self._backlog -= sent
                except (BlockingIOError, InterruptedError):
                    if not self._waiting_to_write:  # the caller is not reading yet: finish when it does
                        self._waiting_to_write = True
                        self._loop.call_soon_threadsafe(self._wait_for_room)
                    return
                except OSError as exc:
                    self.closed = True
                    self._out.clear()
                    self._backlog = 0
                    self._loop.call_soon_threadsafe(self._lost, exc)
                    return

    def _wait_for_room(self) -> None:
        if not self.closed:
            self._loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        with self._lock:
            self._waiting_to_write = False
        self._loop.remove_writer(self.sock.fileno())
        self._flush()
        with self._room:
            self._room.notify_all()

    def move_to(self, loop: asyncio.AbstractEventLoop, loop_thread: int) -> None:
        """Serve this lane on another event loop (run by thread `loop_thread`) from now on; called on the loop
        that serves it now. What was read but not yet handled, and what waits to be written, go along."""
        fd = self.sock.fileno()
        if fd < 0:
            return
        self._loop.remove_reader(fd)
        self._loop.remove_writer(fd)
        with self._lock:
            self._loop, self._loop_thread = loop, loop_thread
            self._waiting_to_write = False
        loop.call_soon_threadsafe(self._resume)

    def _resume(self) -> None:
        if self.closed or self.sock.fileno() < 0:
            return
        self._loop.add_reader(self.sock.fileno(), self._readable)
        if self._out:
            self._flush()

    def close(self) -> None:
        """On the loop thread: stop serving this lane and close it."""
        self._lost(None)

    def _lost(self, exc: Exception | None) -> None:
        """On the loop thread: stop serving this lane."""
        if self.sock.fileno() < 0:
            return
        with self._lock:
            self.closed = True
            self._out.clear()
            self._backlog = 0
        self._loop.remove_reader(self.sock.fileno())
        self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
