"""Relay links between host agents (and call links between ranks): authenticated, encrypted, in order.

Past a branching factor the controller sends a broadcast to a few agents, which relay it
to the others over TCP links between agents; ranks of meshes on different hosts call each
other over the same kind of link (`rank/far_calls.py`). The controller hands out a per-mesh key
over its own encrypted channels (SSH, or the Slurm direct link; never on a command line, never
on one of these links), and each connection then runs an ephemeral key exchange that the key
authenticates (`wire/link_crypto.py` has the primitives):

    child  -> parent   X_c, child's host index
    parent -> child    X_p, HMAC(key, "parent" | T)
    child  -> parent   HMAC(key, "child" | T)
    T = SHA256(X_c | X_p | index);  session keys = HKDF(X25519, salt = HMAC(key, "session" | T), T)

X_c and X_p are fresh X25519 public keys: a reader of the network sees no key and cannot derive
the session's (forward secrecy), and a peer in the middle without the mesh's key fails the
proofs. Every frame then travels in AES-GCM records under the direction's key, numbered by their
nonces: a record that is forged, altered, replayed, dropped or reordered fails its tag and
closes the link.

The controller's direct link to a Slurm node's agent and a persistent mesh's attach socket use
the same records (`RelayLink`) under the keys of their own handshakes (`wire.munge_auth`,
`wire.direct_auth`).
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

from monarch_kernel.wire.link_crypto import (
    DOWN,
    PUBLIC_BYTES,
    RECORD_HEADER,
    UP,
    Ephemeral,
    Opener,
    RecordRefused,
    Sealer,
    Session,
    keyed_session,
    proof,
    transcript_hash,
)
from monarch_kernel.wire.transport import MAX_BUFFER_BYTES, FrameError, decode_frame, encode

__all__ = ["DOWN", "UP", "HANDSHAKE_TIMEOUT_S", "KEY_BYTES", "RelayLink", "RelayRefused", "Session",
           "handshake_as_child", "handshake_as_parent", "new_key", "no_delay", "pipe_streams"]

KEY_BYTES = 32
HANDSHAKE_TIMEOUT_S = 1.0  # a peer on the network answers in far less; a silent one is dropped soon
_MAC = hashlib.sha256().digest_size
_INDEX = struct.Struct("!I")
_LABEL = b"monarch-kernel relay link v2"


class RelayRefused(FrameError):
    """A peer failed the handshake, or sent a record that is forged, altered or replayed."""


def new_key() -> bytes:
    """A fresh relay key for one mesh."""
    return os.urandom(KEY_BYTES)


def no_delay(writer: asyncio.StreamWriter) -> None:
    """Send small frames at once on a link's TCP connection (no Nagle delay)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _session(key: bytes, ours: Ephemeral, theirs: bytes, transcript: bytes) -> Session:
    try:
        return keyed_session(key, ours, theirs, transcript, _LABEL)
    except RecordRefused as exc:
        raise RelayRefused(str(exc)) from None


async def handshake_as_child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes,
                             index: int) -> Session:
    """The child's side: exchange keys, prove the mesh key, check the parent's proof; the session's
    keys (raises RelayRefused)."""
    ours, host = Ephemeral(), _INDEX.pack(index)
    writer.write(ours.public + host)
    await writer.drain()
    answer = await _read(reader, PUBLIC_BYTES + _MAC)
    theirs, parent_proof = answer[:PUBLIC_BYTES], answer[PUBLIC_BYTES:]
    transcript = transcript_hash(ours.public, theirs, host)
    if not hmac.compare_digest(parent_proof, proof(key, b"parent", transcript)):
        raise RelayRefused("the relay parent did not prove the mesh's relay key")
    writer.write(proof(key, b"child", transcript))
    await writer.drain()
    return _session(key, ours, theirs, transcript)


async def handshake_as_parent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              key: bytes) -> tuple[int, Session]:
    """The parent's side: the child's host index and the session's keys (raises RelayRefused)."""
    opening = await _read(reader, PUBLIC_BYTES + _INDEX.size)
    theirs, host = opening[:PUBLIC_BYTES], opening[PUBLIC_BYTES:]
    ours = Ephemeral()
    transcript = transcript_hash(theirs, ours.public, host)
    writer.write(ours.public + proof(key, b"parent", transcript))
    await writer.drain()
    if not hmac.compare_digest(await _read(reader, _MAC), proof(key, b"child", transcript)):
        raise RelayRefused("the connecting peer did not prove the mesh's relay key")
    return _INDEX.unpack(host)[0], _session(key, ours, theirs, transcript)


async def _read(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), HANDSHAKE_TIMEOUT_S)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        raise RelayRefused(f"the relay handshake did not complete ({type(exc).__name__})") from None


class RelayLink:
    """One end of an authenticated, encrypted link: `send(msg)`; each verified message goes to on_message.

    `sending` is the direction this end writes (DOWN for the parent or controller, UP for the
    child or agent). on_close(exc) runs once, when the link ends for any reason (exc says why, or
    None). The reader and writer may be a TCP connection, a Unix socket or a pair of pipes.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 session: Session | tuple[Sealer, Opener], sending: bytes,
                 on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]):
        self._reader = reader
        self._writer = writer
        if isinstance(session, Session):  # (a tuple: the records' state after frames sent before the loop ran)
            seal_key, open_key = session.keys_for(sending)
            session = Sealer(seal_key), Opener(open_key)
        self._sealer, self._opener = session
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
        """Encrypt and write one message (no-op once closed)."""
        self.send_chunks(encode(msg))

    def send_chunks(self, chunks: list[memoryview | bytes]) -> None:
        """Encrypt and write one already encoded frame (the same chunks may go to several links)."""
        if self._closed:
            return
        records = self._sealer.seal(chunks)
        self._writer.writelines(records)
        self.bytes_sent += sum(len(r) for r in records)

    def pause_reading(self) -> None:
        """Deliver nothing more that arrives (the link stays open for what this end still sends)."""
        self._task.cancel()

    def close(self, why: Exception | None = None) -> None:
        """End the link (the peer sees it close)."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        read_side = getattr(self._reader, "_transport", None)  # (a pipe's read side is a transport of its own)
        if read_side is not None and read_side is not self._writer.transport:
            read_side.close()
        if asyncio.current_task() is not self._task:
            self._task.cancel()
        self._on_close(why)

    async def _read_frames(self) -> None:
        try:
            frame = bytearray()
            while True:
                header = await self._reader.readexactly(RECORD_HEADER.size)
                self.last_received = time.monotonic()
                body = await self._reader.readexactly(self._opener.body_length(header))
                self.last_received = time.monotonic()
                plain, last = self._opener.open(header, body)
                frame += plain  # (only what passed its tag is kept: a forged length allocates nothing)
                if len(frame) > MAX_BUFFER_BYTES + (1 << 20):
                    raise RelayRefused(f"a frame on the link grew past {len(frame)} bytes")
                if last:
                    message = decode_frame(frame)
                    frame = bytearray()
                    self._on_message(message)
        except asyncio.CancelledError:
            return
        except RecordRefused as exc:
            self.close(RelayRefused(str(exc)))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.close(None if isinstance(exc, asyncio.IncompleteReadError) else exc)
        except FrameError as exc:
            self.close(exc)


async def pipe_streams(read_fd: int, write_fd: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Asyncio streams over a pair of pipes (a Slurm step's stdin/stdout), for a RelayLink."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 22)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0))
    transport, protocol = await loop.connect_write_pipe(lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
                                                        os.fdopen(write_fd, "wb", buffering=0))
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)
