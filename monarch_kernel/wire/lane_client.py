"""The notebook's end of the direct lanes to its local ranks: calls and requests out, replies,
results and a request's output in.

See `lanes` for what a lane is. Threading: any thread may send; the thread that waits
for replies reads them itself; the controller loop's service tick writes queued calls
and reads replies that nobody waits for.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed, MeshBusyError
from monarch_kernel.core.interrupt_shield import StopsNoted, shielded
from monarch_kernel.wire.lanes import lane_path, peer_is_us, read_available
from monarch_kernel.wire.messages import Display, InputRequest, Output
from monarch_kernel.wire.transport import FrameProtocol, advance, byte_views

PROGRESS = frozenset({Output, Display, InputRequest})  # what a rank sends about a request before its result
BATCH_FRAMES = 64  # queued calls written in one go
QUIET_S = 0.005  # the service tick leaves a lane alone this long after a call was sent


def connect_lane(path: str) -> socket.socket:
    """Connect to a rank's lane."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        if not peer_is_us(sock):  # the folder is private, but do not trust a path alone
            raise PermissionError(f"{path} is served by another user's process")
    except BaseException:
        sock.close()
        raise
    return sock


LANE_HIGH_WATER = 1 << 30  # bytes a busy rank may leave unread on its lane before sends fail fast


class Lane:
    """One direct lane: calls out (from any thread), replies in (read by whoever waits).

    A call goes out at once when the lane is idle. While earlier calls are still
    unanswered, new ones are queued and written together (by the next caller to wait,
    or by the pool's service tick): pipelined calls then cost one system call per batch
    instead of one, and a wake-up of the rank, per call.

    Writes never block: what the socket does not take now (the rank is busy and its
    buffer is full) stays in `_out`, to be written by whoever waits for a reply or by the
    service tick when the socket has room. The controller's loop thread therefore never
    waits on a rank, and an interrupt never leaves half a frame behind.

    Replies are read by the thread that waits for them (no hand-off between threads),
    or by the pool's service tick when nobody waits.

    Locks: `_write_lock` guards the queue, `_out` and socket writes (never held while
    blocking); `read_lock` lets one thread at a time read the socket; `_count_lock`
    guards `unanswered`, which senders raise and readers lower; the pool's lock guards
    `waiters`.
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[Any], None]):
        sock.setblocking(False)
        self.sock = sock
        self.closed = False
        self.read_lock = threading.Lock()
        self._on_message = on_message
        self._write_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._queued: list[memoryview] = []  # whole frames waiting for the next batch
        self._queued_frames = 0
        self._out: list[memoryview] = []  # bytes being written (may end mid-frame)
        self._backlog = 0  # bytes in _queued and _out (kept as they change: a long queue is not summed per call)
        self.last_send = 0.0
        self.unanswered = 0
        self.waiters = 0  # threads reading this lane for their replies (changed under the pool's lock)
        self._reader = FrameProtocol(self._got, self._lost)

    def backlog_bytes(self) -> int:
        """Bytes sent to this lane that the rank has not taken yet."""
        return self._backlog

    def check_room(self, rank: int) -> None:
        """Raise MeshBusyError if this lane already holds LANE_HIGH_WATER bytes the rank has not read."""
        backlog = self._backlog
        if backlog > LANE_HIGH_WATER:
            raise MeshBusyError(
                f"rank {rank} has not read the last {backlog / (1 << 20):,.0f} MiB sent to it (it is busy, "
                f"in a long cell or endpoint); nothing more was sent. Wait for it, interrupt it "
                f"(%mesh interrupt), or send less at a time")

    def send_chunks(self, chunks: list[Any]) -> None:
        """Send (or queue) one encoded frame that will be answered by one reply; never blocks.

        A stop (the notebook's Ctrl-C) that comes meanwhile is raised once the frame is queued or
        sent and counted (`core/interrupt_shield.py`): never half-queued, never sent twice."""
        shielded(lambda: self._send_chunks(chunks))

    def _send_chunks(self, chunks: list[Any]) -> None:
        with self._write_lock:
            if self.closed:
                raise ConnectionClosed("the lane is closed")
            with self._count_lock:
                self.unanswered += 1
                first = self.unanswered == 1
            self.last_send = time.monotonic()
            views = byte_views(chunks)
            self._queued.extend(views)
            self._backlog += sum(v.nbytes for v in views)
            self._queued_frames += 1
            if (first and self._queued_frames == 1) or self._queued_frames >= BATCH_FRAMES:
                self._write_out()  # an idle lane sends at once; a long queue keeps the rank busy

    def flush(self, *, wait_for_lock: bool = True) -> None:
        """Write what is queued, as far as the socket takes it now (the rest stays for later)."""
        if not self._write_lock.acquire(blocking=wait_for_lock):
            return  # another thread is writing: it takes the queue along
        try:
            if not self.closed and (self._queued or self._out):
                try:
                    self._push()
                except ConnectionClosed:
                    pass  # a reader sees the lane close
        finally:
            self._write_lock.release()

    @property
    def busy(self) -> bool:
        """Calls are queued, partly written or unanswered."""
        return bool(self._queued) or bool(self._out) or self.unanswered > 0

    @property
    def wants_write(self) -> bool:
        """Bytes wait for room in the socket."""
        return bool(self._out) or bool(self._queued)

    def drain(self) -> None:
        """Read and dispatch every reply that is already here (caller holds read_lock); a stop waits
        until what was read is counted (`read_available`)."""
        read_available(self.sock, self._reader, self._lost, lambda: self.closed)

    def _got(self, msg: Any) -> None:
        if type(msg) not in PROGRESS:  # an answer (a reply, a result), not output on the way to one
            with self._count_lock:
                self.unanswered = max(0, self.unanswered - 1)
        self._on_message(msg)

    def _lost(self, exc: Exception | None) -> None:
        self.closed = True

    def _push(self) -> None:
        """Move the queue to `_out` and write until the socket is full (caller holds _write_lock); a stop
        meanwhile is raised after what was written is dropped from `_out`."""
        shielded(self._write_out)

    def _write_out(self) -> None:
        if self._queued:
            self._out.extend(self._queued)
            self._queued, self._queued_frames = [], 0
        while self._out:
            try:
                sent = self.sock.sendmsg(self._out[:512])
                advance(self._out, sent)
                self._backlog -= sent
            except (BlockingIOError, InterruptedError):
                return  # full: the rank is busy; the tick or a waiting caller goes on later
            except OSError as exc:
                self.closed = True
                self._out.clear()
                self._queued, self._backlog = [], 0
                raise ConnectionClosed(str(exc)) from exc

    def close(self) -> None:
        """Shut the socket down and release it; waiters see the lane closed."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


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

    def send(self, lane: Lane, chunks: list[Any]) -> None:
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
        """Write every queued call now (as far as each socket takes it)."""
        for lane in list(self._lanes.values()):
            lane.flush()

    def wait(self, ranks: tuple[int, ...], done: Callable[[], bool], timeout: float | None) -> bool | None:
        """Read the lanes of these ranks on this thread until done() (True) or timeout (False).

        None when some rank has no open lane (the caller then waits the usual way).
        """
        lanes = [self._lanes.get(r) for r in ranks]
        open_lanes = [lane for lane in lanes if lane is not None and not lane.closed]
        if len(open_lanes) < len(lanes):
            return None
        unique = list({id(lane): lane for lane in open_lanes}.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for lane in unique:
                lane.waiters += 1
        try:
            with StopsNoted() as stops:  # (one handler change for the whole wait, not one per read)
                return self._read_until(unique, done, deadline, stops)
        finally:
            with self._lock:
                for lane in unique:
                    lane.waiters -= 1

    def _read_until(self, lanes: list[Lane], done: Callable[[], bool], deadline: float | None,
                    stops: StopsNoted) -> bool:
        """Read until done() or the deadline; a stop (Ctrl-C) is raised between reads, at most one select
        (50 ms) after it came (a read and its count are never split: `core/interrupt_shield.py`)."""
        ready = lanes  # read what is there already; then only the lanes select says have bytes
        while True:
            stops.raise_if_noted()
            shared = False  # another thread may read our replies: poll, do not sleep in select
            for lane in ready:
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
            shared = shared or any(lane.waiters > 1 for lane in lanes)
            for lane in lanes:
                if lane.wants_write:
                    lane.flush(wait_for_lock=False)  # what the socket had no room for
            open_lanes = [lane for lane in lanes if not lane.closed]
            writing = [lane.sock for lane in open_lanes if lane.wants_write]
            try:
                if not open_lanes:
                    time.sleep(min(wait, 0.001))  # the rank died: its failure comes another way
                    ready = []
                    continue
                readable, _, _ = select.select([lane.sock for lane in open_lanes], writing, [],
                                               min(wait, 0.001) if shared else wait)
            except (OSError, ValueError):
                ready = []
                continue  # a lane closed under us (a restart): the next round sees it
            ready = [lane for lane in open_lanes if lane.sock in readable]

    def _tick(self) -> None:
        """On the loop thread: write queued calls, read replies nobody is waiting for."""
        now = time.monotonic()
        for lane in list(self._lanes.values()):
            if lane.busy:
                self._last_busy = now
                if now - lane.last_send < QUIET_S:
                    continue  # a caller is busy sending: it flushes, and reads when it waits
                lane.flush(wait_for_lock=False)  # never waits: the loop thread must not block on a rank
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
