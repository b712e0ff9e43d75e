"""Direct lanes: a Unix socket from the notebook's process straight to a local rank.

Actor calls from the notebook to ranks on this machine skip the controller thread and
the host agent: the calling thread writes the frame to the rank's lane, the rank
answers on it. Each rank listens at `<private dir>/rank-N.sock`; the folder is mode
0700 and every accepted peer must run as our own user (SO_PEERCRED), so only this
user's processes can reach a lane. Lanes exist only on one machine; ranks on SSH
hosts are reached through their host agent.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import threading

from .transport import ConnectionClosed, advance, byte_views

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def lane_path(private_dir: str, rank: int) -> str:
    """Where rank `rank` listens."""
    return os.path.join(private_dir, f"rank-{rank}.sock")


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
    _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid != os.getuid():
        conn.close()
        return None
    return conn


def connect_lane(path: str) -> socket.socket:
    """Connect to a rank's lane."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


class LaneWriter:
    """Writes frames to a lane from any thread (the socket itself is read by an event loop).

    A call goes out at once when the lane is idle. While earlier calls are still
    unanswered, new ones are queued and written together by the reading loop (woken
    once per batch) or by a caller about to wait: pipelined calls then cost one
    system call per batch instead of one (and a wake-up of the rank) per call.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self.sock = sock
        self.closed = False
        self._loop = loop
        self._lock = threading.Lock()
        self._queued: list[memoryview] = []
        self._unanswered = 0

    def send_chunks(self, chunks: list) -> None:
        """Send (or queue) one encoded frame that will be answered by one reply."""
        wake = False
        with self._lock:
            if self.closed:
                raise ConnectionClosed("the lane is closed")
            self._unanswered += 1
            if self._unanswered == 1 and not self._queued:
                self._write(byte_views(chunks))
                return
            wake = not self._queued
            self._queued.extend(byte_views(chunks))
        if wake:
            self._loop.call_soon_threadsafe(self.flush)

    def answered(self) -> None:
        """One reply came back."""
        with self._lock:
            self._unanswered = max(0, self._unanswered - 1)

    def flush(self) -> None:
        """Write whatever is queued."""
        with self._lock:
            if self._queued and not self.closed:
                views, self._queued = self._queued, []
                try:
                    self._write(views)
                except ConnectionClosed:
                    pass  # the reading side reports the closed lane

    def _write(self, views: list[memoryview]) -> None:
        while views:
            try:
                advance(views, self.sock.sendmsg(views[:512]))
            except (BlockingIOError, InterruptedError):
                select.select([], [self.sock], [], 1.0)
            except OSError as exc:
                self.closed = True
                raise ConnectionClosed(str(exc)) from exc
