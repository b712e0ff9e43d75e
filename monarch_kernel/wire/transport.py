"""Framed messages over stream sockets, for asyncio and for blocking code.

A frame is a header (pickle length, buffer count, buffer lengths), a protocol-5
pickle of the message, then its out-of-band buffers. Receivers read each buffer
straight into its own bytearray; senders hand the buffers to the kernel without
joining them. Connections are only ever socketpairs inherited from the parent or
streams inside an SSH connection: nothing here listens on a port.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.core.interrupt_shield import shielded
from monarch_kernel.wire import safe_pickle
from monarch_kernel.wire.flat import flatten, unflatten

_HEAD = struct.Struct("!II")
_LEN = struct.Struct("!Q")
_FLAT = 1 << 31  # flag in the buffer-count field: the pickle is a flat tuple (wire/flat.py)

MAX_META_BYTES = 256 << 20  # a message's own pickle (values travel as buffers)
MAX_BUFFERS = 4096
def _default_max_buffer() -> int:
    """Half of this machine's memory, and at most 64 GiB: a header alone never makes us allocate more."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 64 << 30
    return int(min(64 << 30, max(1 << 30, memory // 2)))


MAX_BUFFER_BYTES = int(os.environ.get("MONARCH_KERNEL_MAX_BUFFER_BYTES") or _default_max_buffer())


def lazy_buffer(size: int) -> Any:
    """A writable buffer of `size` bytes whose pages are zeroed only when first touched (large sizes)."""
    if size < LAZY_BUFFER_BYTES:
        return bytearray(size)
    return mmap.mmap(-1, size)


LAZY_BUFFER_BYTES = 1 << 20


class FrameError(ConnectionClosed):
    """A peer sent a frame we cannot read (size over a limit, bad pickle): its connection is closed."""


def check_header(meta_len: int, nbufs: int) -> None:
    """Raise FrameError for a header announcing more than a frame may hold."""
    if not 0 < meta_len <= MAX_META_BYTES:
        raise FrameError(f"a frame announced a {meta_len}-byte message (at most {MAX_META_BYTES})")
    if nbufs > MAX_BUFFERS:
        raise FrameError(f"a frame announced {nbufs} buffers (at most {MAX_BUFFERS})")


def check_sizes(sizes: list[int]) -> None:
    """Raise FrameError for a buffer larger than MONARCH_KERNEL_MAX_BUFFER_BYTES."""
    for size in sizes:
        if size > MAX_BUFFER_BYTES:
            raise FrameError(f"a frame announced a {size}-byte buffer (at most {MAX_BUFFER_BYTES}; "
                             "set MONARCH_KERNEL_MAX_BUFFER_BYTES for larger values)")


def encode(msg: Any) -> list[memoryview | bytes]:
    """Serialize a message into the list of byte chunks that form one frame."""
    buffers: list[pickle.PickleBuffer] = []
    flat = flatten(msg)
    meta = pickle.dumps(msg if flat is None else flat, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    count = len(raws) | (0 if flat is None else _FLAT)
    header = _HEAD.pack(len(meta), count) + b"".join(_LEN.pack(r.nbytes) for r in raws)
    return [header + meta, *raws]


def decode(meta: bytes | bytearray, buffers: list[bytearray], flat: bool = False) -> Any:
    """Rebuild a message from a frame's pickle and buffers (raises FrameError if it is not one)."""
    try:
        obj = safe_pickle.loads(meta, buffers)
        return unflatten(obj) if flat else obj
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, the stream is not ours to trust
        raise FrameError(f"a frame could not be read ({type(exc).__name__}: {exc})") from exc


def decode_frame(frame: bytearray) -> Any:
    """Rebuild a message from one whole frame held in memory (its buffers are views of `frame`)."""
    view = memoryview(frame)
    if len(view) < _HEAD.size:
        raise FrameError("a frame shorter than its header")
    meta_len, count = _HEAD.unpack_from(view)
    nbufs = count & ~_FLAT
    check_header(meta_len, nbufs)
    at = _HEAD.size + nbufs * _LEN.size
    sizes = [_LEN.unpack_from(view, _HEAD.size + i * _LEN.size)[0] for i in range(nbufs)] if at <= len(view) else []
    check_sizes(sizes)
    if at + meta_len + sum(sizes) != len(view):
        raise FrameError("a frame whose parts do not add up to its length")
    meta = view[at:at + meta_len]
    at += meta_len
    parts = []
    for size in sizes:
        parts.append(view[at:at + size])
        at += size
    return decode(meta, parts, bool(count & _FLAT))  # type: ignore[arg-type]  # views of a writable frame


# ------------------------------------------------------------------ asyncio side


class FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames directly into per-buffer bytearrays and calls on_message."""

    def __init__(self, on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]):
        self._on_message = on_message
        self._on_close = on_close
        self._small = bytearray(1 << 16)
        self._pending = bytearray()
        self._want: list[int] = []  # sizes still to read for the current frame body
        self._parts: list[bytearray] = []
        self._target: bytearray | None = None
        self._filled = 0
        self._flat = False
        self._broken = False
        self.transport: asyncio.Transport | None = None
        self.last_received = time.monotonic()  # bytes are a sign of life, even halfway through a large frame

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """asyncio: the transport is ready."""
        self.transport = transport  # type: ignore[assignment]  # a stream's transport

    def get_buffer(self, sizehint: int) -> memoryview:
        """asyncio: where to read the next bytes."""
        if self._target is not None:
            return memoryview(self._target)[self._filled:]
        return memoryview(self._small)

    def buffer_updated(self, nbytes: int) -> None:
        """asyncio: nbytes were read into the buffer (a frame we cannot read closes the connection)."""
        self.last_received = time.monotonic()
        if self._broken:
            return
        try:
            self._take(nbytes)
        except FrameError as exc:
            self._broken = True
            self._small = bytearray(1 << 16)  # nothing more is parsed: drop what was half read
            self._pending, self._parts, self._target, self._want = bytearray(), [], None, []
            if self.transport is not None:
                self.transport.close()
            self._on_close(exc)

    def _take(self, nbytes: int) -> None:
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._part_done()
            return
        self._pending += memoryview(self._small)[:nbytes]
        self._drain_pending()

    def _drain_pending(self) -> None:
        while True:
            if not self._want:
                if not self._parse_header():
                    return
            size = self._want[0]
            if size > (1 << 16) and len(self._pending) < size:
                # large part: read the rest of it straight into its own buffer, lazily zeroed (an anonymous
                # mapping: pages come as bytes arrive, not a GiB memset on the loop when the header does)
                part = lazy_buffer(size)
                have = len(self._pending)
                part[:have] = self._pending
                self._pending = bytearray()
                self._target, self._filled = part, have
                return
            if len(self._pending) < size:
                return
            part = self._pending[:size]
            del self._pending[:size]
            self._parts.append(part)
            self._want.pop(0)
            if not self._want:
                self._frame_done()

    def _part_done(self) -> None:
        assert self._target is not None
        self._parts.append(self._target)
        self._target = None
        self._want.pop(0)
        if not self._want:
            self._frame_done()
        self._drain_pending()

    def _parse_header(self) -> bool:
        if len(self._pending) < _HEAD.size:
            return False
        meta_len, count = _HEAD.unpack_from(self._pending)
        nbufs = count & ~_FLAT
        head_len = _HEAD.size + nbufs * _LEN.size
        check_header(meta_len, nbufs)
        if len(self._pending) < head_len:
            return False
        sizes = [_LEN.unpack_from(self._pending, _HEAD.size + i * _LEN.size)[0] for i in range(nbufs)]
        check_sizes(sizes)
        del self._pending[:head_len]
        self._want = [meta_len, *sizes]
        self._flat = bool(count & _FLAT)
        return True

    def _frame_done(self) -> None:
        meta, *bufs = self._parts
        self._parts = []
        self._on_message(decode(meta, bufs, self._flat))

    def mute(self) -> None:
        """Drop every frame from now on (its connection is being handed over or closed)."""
        self._on_message = _drop

    def data_received(self, data: bytes) -> None:
        """For transports that do not fill our buffers directly (pipes)."""
        view = memoryview(data)
        while view:
            target = self.get_buffer(len(view))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]

    def eof_received(self) -> bool:
        """asyncio: the peer closed its end."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio: the connection closed."""
        if not self._broken:  # a bad frame already reported why
            self._on_close(exc)


def _drop(msg: Any) -> None:
    """Where a muted connection's frames go."""


class AsyncConnection:
    """A framed connection on the asyncio loop: send() queues, messages arrive by callback."""

    def __init__(self, transport: asyncio.Transport, protocol: FrameProtocol,
                 reader: asyncio.BaseTransport | None = None):
        self._transport = transport
        self._protocol = protocol
        self._reader = reader  # a separate read side (pipes), else the transport reads too
        self.bytes_sent = 0  # what send() has queued in all

    @classmethod
    async def from_socket(
        cls, sock: socket.socket, on_message: Callable[[Any], None],
        on_close: Callable[[Exception | None], None],
    ) -> AsyncConnection:
        """Wrap a connected stream socket."""
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_accepted_socket(
            lambda: FrameProtocol(on_message, on_close), sock
        )
        return cls(transport, protocol)

    @classmethod
    async def from_pipes(
        cls, read_fd: int, write_fd: int, on_message: Callable[[Any], None],
        on_close: Callable[[Exception | None], None],
    ) -> AsyncConnection:
        """Wrap a pair of file descriptors (an agent's stdin/stdout over SSH)."""
        import os

        loop = asyncio.get_running_loop()
        writer, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(write_fd, "wb", buffering=0))
        reader, protocol = await loop.connect_read_pipe(
            lambda: FrameProtocol(on_message, on_close), os.fdopen(read_fd, "rb", buffering=0))
        return cls(writer, protocol, reader)  # type: ignore[arg-type]  # a pipe's write transport

    @property
    def last_received(self) -> float:
        """When bytes last arrived (time.monotonic()), complete frame or not."""
        return self._protocol.last_received

    def backlog(self) -> int:
        """Bytes queued here, not yet taken by the peer's side."""
        return self._transport.get_write_buffer_size()

    def send(self, msg: Any) -> None:
        """Queue one message (never blocks)."""
        self.send_chunks(encode(msg))

    def send_chunks(self, chunks: list[memoryview | bytes]) -> None:
        """Queue an already encoded frame (to send one encoding to many peers)."""
        if self._transport.is_closing():
            raise ConnectionClosed("connection is closed")
        size = sum(memoryview(c).nbytes for c in chunks)
        self.bytes_sent += size
        if len(chunks) > 1 and size < (1 << 16):
            self._transport.write(b"".join(chunks))  # one system call for small frames
            return
        for chunk in chunks:
            self._transport.write(chunk)

    def pause_reading(self) -> None:
        """Deliver nothing more that arrives (what this end still sends goes out)."""
        self._protocol.mute()
        reading = self._reader if self._reader is not None else self._transport
        if isinstance(reading, asyncio.ReadTransport):
            reading.pause_reading()

    def close(self) -> None:
        """Close the connection."""
        self._transport.close()
        if self._reader is not None:
            self._reader.close()

    @property
    def closed(self) -> bool:
        """Whether the connection is closed or closing."""
        return self._transport.is_closing()


# ------------------------------------------------------------------ blocking side


class BlockingConnection:
    """A framed connection for plain threads (the rank's side)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._rfile = sock.makefile("rb", buffering=1 << 16)
        self._send_lock = threading.Lock()

    def send(self, msg: Any) -> None:
        """Send one message; safe to call from several threads."""
        chunks = encode(msg)
        with self._send_lock:
            try:
                _sendall_chunks(self._sock, chunks)
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from exc

    def recv(self) -> Any:
        """Block until one message arrives."""
        head = self._recv_exact(_HEAD.size)
        meta_len, count = _HEAD.unpack(head)
        check_header(meta_len, count & ~_FLAT)
        sizes = [_LEN.unpack(self._recv_exact(_LEN.size))[0] for _ in range(count & ~_FLAT)]
        check_sizes(sizes)
        meta = self._recv_exact(meta_len)
        buffers = [self._recv_exact(n) for n in sizes]
        return decode(meta, buffers, bool(count & _FLAT))

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self._rfile.readinto(view[got:])  # type: ignore[attr-defined]  # a raw socket file
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from exc
            if not k:
                raise ConnectionClosed("peer closed the connection")
            got += k
        return buf

    def close(self) -> None:
        """Close the socket (and the reader that shares its file descriptor)."""
        for closable in (self._rfile, self._sock):
            try:
                closable.close()
            except OSError:
                pass


def byte_views(chunks: list[memoryview | bytes]) -> list[memoryview]:
    """The non-empty chunks of a frame as byte views, ready for sendmsg()."""
    views = []
    for chunk in chunks:
        view = memoryview(chunk)
        if view.nbytes:
            views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


def advance(views: list[memoryview], sent: int) -> None:
    """Drop `sent` bytes from the front of views (after a partial sendmsg)."""
    while sent and views:
        first = views[0]
        if sent >= first.nbytes:
            sent -= first.nbytes
            views.pop(0)
        else:
            views[0] = first[sent:]
            sent = 0


def _sendall_chunks(sock: socket.socket, chunks: list[memoryview | bytes]) -> None:
    """Send a whole frame on a blocking socket; a stop meanwhile is raised once it is all sent (half a
    frame would leave the stream out of step for good)."""
    views = byte_views(chunks)

    def send_all() -> None:
        while views:
            advance(views, sock.sendmsg(views[:64]))

    shielded(send_all)
