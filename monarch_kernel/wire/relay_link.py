"""Relay links between host agents: authenticated both ways, and every frame sealed against forgery and replay.

Past a branching factor the controller sends a broadcast to a few agents, which relay it
to the others over TCP links between agents. A link is as trusted as the controller's
own channels: the controller hands out a per-mesh relay key over those channels (never
on a command line), and

- the handshake proves the key both ways without sending it, over fresh nonces from
  both ends, and derives this link's own session key from them:

      child  -> parent   nonce_c, child's host index
      parent -> child    nonce_p, HMAC(key, "parent" | nonce_c | nonce_p | index)
      child  -> parent   HMAC(key, "child" | nonce_p | nonce_c | index)
      session key = HMAC(key, "session" | nonce_c | nonce_p | index)

- every frame then carries a sequence number and an HMAC-SHA256 under the session key
  over the direction, the number, the length and the bytes. A frame whose MAC is wrong
  (forged or altered), or whose number is not the next one (replayed, dropped or
  reordered), is refused: the link closes and the controller hears why. Frames recorded
  on one link prove nothing on another (their session keys differ).

The controller's direct link to a Slurm node's agent uses the same sealed frames, under the
session key of its own handshake (`wire.direct_auth`). Frames are not encrypted (like gloo
and NCCL traffic).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.wire.transport import MAX_BUFFER_BYTES, FrameError, decode_frame, encode

KEY_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_INDEX = struct.Struct("!I")
_HEADER = struct.Struct("!QQ")  # sequence number, frame length
DOWN, UP = b"down", b"up"  # the two directions of a link (parent -> child, child -> parent)


class RelayRefused(FrameError):
    """A peer failed the handshake, or sent a frame that is forged, altered or replayed."""


def new_key() -> bytes:
    """A fresh relay key for one mesh."""
    return os.urandom(KEY_BYTES)


def no_delay(writer: asyncio.StreamWriter) -> None:
    """Send small frames at once on a link's TCP connection (no Nagle delay)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


async def handshake_as_child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes,
                             index: int) -> bytes:
    """The child's side: prove the key, check the parent's proof; the session key (raises RelayRefused)."""
    nonce_c, host = os.urandom(_NONCE), _INDEX.pack(index)
    writer.write(nonce_c + host)
    await writer.drain()
    answer = await _read(reader, _NONCE + _MAC)
    nonce_p, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"parent", nonce_c, nonce_p, host)):
        raise RelayRefused("the relay parent did not prove the mesh's relay key")
    writer.write(_mac(key, b"child", nonce_p, nonce_c, host))
    await writer.drain()
    return _mac(key, b"session", nonce_c, nonce_p, host)


async def handshake_as_parent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              key: bytes) -> tuple[int, bytes]:
    """The parent's side: the child's host index and the session key (raises RelayRefused)."""
    opening = await _read(reader, _NONCE + _INDEX.size)
    nonce_c, host = opening[:_NONCE], opening[_NONCE:]
    nonce_p = os.urandom(_NONCE)
    writer.write(nonce_p + _mac(key, b"parent", nonce_c, nonce_p, host))
    await writer.drain()
    if not hmac.compare_digest(await _read(reader, _MAC), _mac(key, b"child", nonce_p, nonce_c, host)):
        raise RelayRefused("the connecting peer did not prove the mesh's relay key")
    return _INDEX.unpack(host)[0], _mac(key, b"session", nonce_c, nonce_p, host)


async def _read(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), HANDSHAKE_TIMEOUT_S)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        raise RelayRefused(f"the relay handshake did not complete ({type(exc).__name__})") from None


class RelayLink:
    """One end of an authenticated relay link: `send(msg)`; each verified message goes to on_message.

    `sending` is the direction this end writes (DOWN for the parent, UP for the child).
    on_close(exc) runs once, when the link ends for any reason (exc says why, or None).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: bytes, sending: bytes,
                 on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]):
        self._reader = reader
        self._writer = writer
        self._session = session
        self._out, self._in = (DOWN, UP) if sending == DOWN else (UP, DOWN)
        self._sent = 0
        self._received = 0
        self._on_message = on_message
        self._on_close = on_close
        self._closed = False
        self.bytes_sent = 0
        self.last_received = 0.0  # when bytes last came (a large frame arriving is a sign of life)
        self._task = asyncio.get_running_loop().create_task(self._read_frames())

    def backlog(self) -> int:
        """Bytes written but not yet taken by the peer."""
        transport = self._writer.transport
        return 0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()

    @property
    def closed(self) -> bool:
        """Whether the link has ended."""
        return self._closed

    def send(self, msg: Any) -> None:
        """Seal and write one message (no-op once closed)."""
        self.send_chunks(encode(msg))

    def send_chunks(self, chunks: list[memoryview | bytes]) -> None:
        """Seal and write one already encoded frame (the same chunks may go to several links)."""
        if self._closed:
            return
        self._sent += 1
        length = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
        header = _HEADER.pack(self._sent, length)
        mac = hmac.new(self._session, self._out + header, hashlib.sha256)
        for chunk in chunks:
            mac.update(chunk)
        self._writer.writelines([header, mac.digest(), *chunks])
        self.bytes_sent += _HEADER.size + _MAC + length

    def close(self, why: Exception | None = None) -> None:
        """End the link (the peer sees it close)."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        if asyncio.current_task() is not self._task:
            self._task.cancel()
        self._on_close(why)

    async def _read_frames(self) -> None:
        try:
            while True:
                head = await self._reader.readexactly(_HEADER.size + _MAC)
                self.last_received = time.monotonic()
                seq, length = _HEADER.unpack_from(head)
                if length > MAX_BUFFER_BYTES + (1 << 20):
                    raise RelayRefused(f"a relay frame announced {length} bytes")
                # grown as the bytes arrive, not allocated from the header: the MAC can only be
                # checked at the end, and a forged header must not make us allocate what it names
                frame = bytearray()
                while len(frame) < length:
                    chunk = await self._reader.read(min(length - len(frame), 1 << 22))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", length - len(frame))
                    frame += chunk
                    self.last_received = time.monotonic()
                mac = hmac.new(self._session, self._in + head[:_HEADER.size], hashlib.sha256)
                mac.update(frame)
                if not hmac.compare_digest(mac.digest(), head[_HEADER.size:]):
                    raise RelayRefused("a relay frame failed its MAC (forged or altered); the link is closed")
                if seq != self._received + 1:
                    raise RelayRefused(f"a relay frame came with number {seq} where {self._received + 1} was due "
                                       "(replayed or reordered); the link is closed")
                self._received = seq
                self._on_message(decode_frame(frame))
        except asyncio.CancelledError:
            return
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.close(None if isinstance(exc, asyncio.IncompleteReadError) else exc)
        except FrameError as exc:
            self.close(exc)
