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
import time
from collections.abc import Callable
from typing import Any

from .transport import ConnectionClosed, FrameProtocol, advance, byte_views, encode

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
BATCH_FRAMES = 64  # queued calls written in one go
QUIET_S = 0.005  # the service tick leaves a lane alone this long after a call was sent


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


def read_available(sock: socket.socket, reader: FrameProtocol, lost: Callable[[Exception | None], None],
                   closed: Callable[[], bool]) -> None:
    """Feed every byte already waiting on a non-blocking socket to a frame reader."""
    while not closed():
        buf = reader.get_buffer(-1)
        try:
            n = sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            lost(exc)
            return
        if n == 0:
            lost(None)
            return
        reader.buffer_updated(n)


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


def connect_lane(path: str) -> socket.socket:
    """Connect to a rank's lane."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


class Lane:
    """One direct lane: calls out (from any thread), replies in (read by whoever waits).

    A call goes out at once when the lane is idle. While earlier calls are still
    unanswered, new ones are queued and written together (by the next caller to wait,
    or by the pool's service tick): pipelined calls then cost one system call per batch
    instead of one, and a wake-up of the rank, per call.

    Replies are read by the thread that waits for them (no hand-off between threads),
    or by the pool's service tick when nobody waits.
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[Any], None]):
        sock.setblocking(False)
        self.sock = sock
        self.closed = False
        self.read_lock = threading.Lock()
        self._on_message = on_message
        self._write_lock = threading.Lock()
        self._queued: list[memoryview] = []
        self._queued_frames = 0
        self.last_send = 0.0
        self.unanswered = 0
        self.waiters = 0  # threads reading this lane for their replies (guarded by read_lock use)
        self._reader = FrameProtocol(self._got, self._lost)

    def send_chunks(self, chunks: list) -> None:
        """Send (or queue) one encoded frame that will be answered by one reply."""
        with self._write_lock:
            if self.closed:
                raise ConnectionClosed("the lane is closed")
            self.unanswered += 1
            self.last_send = time.monotonic()
            if self.unanswered == 1 and not self._queued:
                self._write(byte_views(chunks))
                return
            self._queued.extend(byte_views(chunks))
            self._queued_frames += 1
            if self._queued_frames >= BATCH_FRAMES:  # keep the rank busy while we queue more
                views, self._queued, self._queued_frames = self._queued, [], 0
                self._write(views)

    def flush(self) -> None:
        """Write whatever is queued."""
        with self._write_lock:
            if self._queued and not self.closed:
                views, self._queued, self._queued_frames = self._queued, [], 0
                try:
                    self._write(views)
                except ConnectionClosed:
                    pass  # a reader sees the lane close

    @property
    def busy(self) -> bool:
        """Calls are queued or unanswered."""
        return bool(self._queued) or self.unanswered > 0

    def drain(self) -> None:
        """Read and dispatch every reply that is already here (caller holds read_lock)."""
        read_available(self.sock, self._reader, self._lost, lambda: self.closed)

    def _got(self, msg: Any) -> None:
        self.unanswered = max(0, self.unanswered - 1)
        self._on_message(msg)

    def _lost(self, exc: Exception | None) -> None:
        self.closed = True

    def _write(self, views: list[memoryview]) -> None:
        while views:
            try:
                advance(views, self.sock.sendmsg(views[:512]))
            except (BlockingIOError, InterruptedError):
                select.select([], [self.sock], [], 1.0)
            except OSError as exc:
                self.closed = True
                raise ConnectionClosed(str(exc)) from exc

    def close(self) -> None:
        """Close the socket; waiters see the lane closed."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LanePool:
    """The notebook's lanes to the local ranks of one mesh, and their service tick."""

    SERVICE_INTERVAL_S = 0.002  # while calls are in flight nobody waits on
    IDLE_AFTER_S = 1.0

    def __init__(self, private_dir: str, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None]):
        self._dir = private_dir
        self._loop = loop
        self._on_message = on_message
        self._lanes: dict[int, Lane] = {}
        self._lock = threading.Lock()
        self._ticking = False
        self._last_busy = 0.0

    def get(self, rank: int) -> Lane | None:
        """The open lane to a rank (connected on first use), or None."""
        lane = self._lanes.get(rank)
        if lane is not None and not lane.closed:
            return lane
        with self._lock:
            lane = self._lanes.get(rank)
            if lane is None or lane.closed:
                try:
                    lane = Lane(connect_lane(lane_path(self._dir, rank)), self._on_message)
                except OSError:
                    return None
                self._lanes[rank] = lane
            return lane

    def send(self, lane: Lane, chunks: list) -> None:
        """Send a call on a lane; makes sure the service tick runs."""
        lane.send_chunks(chunks)
        if not self._ticking:
            with self._lock:
                if self._ticking:
                    return
                self._ticking = True
            self._last_busy = time.monotonic()
            self._loop.call_soon_threadsafe(self._tick)

    def flush(self) -> None:
        """Write every queued call now."""
        for lane in list(self._lanes.values()):
            lane.flush()

    def wait(self, ranks: tuple[int, ...], done: Callable[[], bool], timeout: float | None) -> bool | None:
        """Read the lanes of these ranks on this thread until done() (True) or timeout (False).

        None when some rank has no open lane (the caller then waits the usual way).
        """
        lanes = [self._lanes.get(r) for r in ranks]
        if any(lane is None or lane.closed for lane in lanes):
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        unique = list({id(lane): lane for lane in lanes}.values())
        with self._lock:
            for lane in unique:
                lane.waiters += 1
        try:
            return self._read_until(unique, done, deadline)
        finally:
            with self._lock:
                for lane in unique:
                    lane.waiters -= 1

    def _read_until(self, lanes: list[Lane], done: Callable[[], bool], deadline: float | None) -> bool:
        while not done():
            shared = False  # another thread may read our replies: poll, do not sleep in select
            for lane in lanes:
                shared = shared or lane.waiters > 1
                if lane.read_lock.acquire(blocking=False):
                    try:
                        lane.drain()
                    finally:
                        lane.read_lock.release()
                else:
                    shared = True
            if done():
                return True
            wait = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if wait <= 0:
                return False
            open_socks = [lane.sock for lane in lanes if not lane.closed]
            if not open_socks:
                time.sleep(min(wait, 0.001))  # the rank died: its failure comes another way
            else:
                select.select(open_socks, [], [], min(wait, 0.001) if shared else wait)
        return True

    def _tick(self) -> None:
        """On the loop thread: write queued calls, read replies nobody is waiting for."""
        now = time.monotonic()
        for lane in list(self._lanes.values()):
            if lane.busy:
                self._last_busy = now
                if now - lane.last_send < QUIET_S:
                    continue  # a caller is busy sending: it flushes, and reads when it waits
                lane.flush()
                if not lane.waiters and lane.read_lock.acquire(blocking=False):
                    try:
                        lane.drain()
                    finally:
                        lane.read_lock.release()
        with self._lock:
            if now - self._last_busy > self.IDLE_AFTER_S or not self._lanes:
                self._ticking = False
                return
        self._loop.call_later(self.SERVICE_INTERVAL_S, self._tick)

    def close(self) -> None:
        """Close every lane (a restart or shutdown)."""
        with self._lock:
            for lane in self._lanes.values():
                lane.close()
            self._lanes.clear()
