"""The cryptography of every TCP link we open ourselves: an ephemeral key exchange, then AEAD records.

Each end of a new connection makes a fresh X25519 key pair and sends its public half. How the
exchange is authenticated depends on the link (a shared key handed out over an already encrypted
channel: `wire/relay_link.py`, `wire/direct_auth.py`; munge credentials on a Slurm cluster:
`wire/munge_auth.py`), but in every case the session's keys come from the X25519 shared secret,
so a reader who recorded the connection learns nothing from it even if a long-lived key leaks
later (forward secrecy), and a long-lived key is never what encrypts.

    keys = HKDF-SHA256(ikm = X25519(ours, theirs), salt = binding, info = label | SHA256(transcript))

`binding` is what authenticates the exchange (an HMAC of the shared key over the transcript, or
the hash of both munge credentials); the transcript holds both public keys and whatever else
the handshake sent. HKDF yields one key per direction (DOWN: parent/controller -> child/agent,
UP: the other way).

Frames are then cut into records of at most RECORD_BYTES, each AES-256-GCM encrypted under its
direction's key with a 96-bit nonce that counts the records sent (never reused: each key is used
by one sender only, and a link never sends 2**64 records). The record's header (its length and
whether it ends a frame) is the additional data, so nothing can be cut, moved, replayed or
altered without the next tag failing. Library code only (`cryptography`, OpenSSL underneath): no
cipher or MAC of our own.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PUBLIC_BYTES = 32
KEY_BYTES = 32
TAG_BYTES = 16
RECORD_BYTES = 1 << 20  # plaintext per record: a forged length never makes us hold more than this unchecked
RECORD_HEADER = struct.Struct("!IB")  # plaintext length, flags
LAST = 1  # flag: this record ends its frame
DOWN, UP = b"down", b"up"  # the two directions of a link (parent/controller -> child/agent, and back)


class RecordRefused(ConnectionError):
    """A record failed its tag (forged, altered, replayed, reordered or cut) or announced too much."""


class Ephemeral:
    """One side's X25519 key pair for one connection (never reused, never stored)."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw)

    def shared(self, peer_public: bytes) -> bytes:
        """The X25519 shared secret with the peer's public key (raises RecordRefused for a bad key)."""
        if len(peer_public) != PUBLIC_BYTES:
            raise RecordRefused("the peer's public key has the wrong length")
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:  # a low-order point: the exchange would give a known secret
            raise RecordRefused("the peer sent an unusable public key") from None
        return shared


@dataclass(frozen=True)
class Session:
    """The two keys of one link: `down` encrypts what the parent/controller sends, `up` the other way."""

    down: bytes
    up: bytes

    def keys_for(self, sending: bytes) -> tuple[bytes, bytes]:
        """(the key this end seals with, the key it opens with), for the direction it writes."""
        return (self.down, self.up) if sending == DOWN else (self.up, self.down)


def transcript_hash(*parts: bytes) -> bytes:
    """SHA-256 over length-prefixed parts (no two different transcripts hash the same bytes)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(struct.pack("!I", len(part)))
        digest.update(part)
    return digest.digest()


def derive_session(shared: bytes, binding: bytes, label: bytes, transcript: bytes) -> Session:
    """The link's two keys from the exchange's shared secret, what authenticated it, and its transcript."""
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=binding,
               info=label + transcript).derive(shared)
    return Session(okm[:KEY_BYTES], okm[KEY_BYTES:])


def proof(key: bytes, role: bytes, transcript: bytes) -> bytes:
    """HMAC-SHA256 of a shared key over a role and a handshake's transcript (what each end sends to prove it)."""
    return hmac.new(key, role + b"|" + transcript, hashlib.sha256).digest()


def keyed_session(key: bytes, ours: Ephemeral, theirs: bytes, transcript: bytes, label: bytes) -> Session:
    """The session of an exchange that a shared key authenticated (raises RecordRefused for a bad public key)."""
    return derive_session(ours.shared(theirs), proof(key, b"session", transcript), label, transcript)


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class Sealer:
    """Encrypts the records of one direction (one per link end; not thread-safe: one writer)."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._count = 0

    def seal(self, chunks: list[memoryview | bytes]) -> list[bytes]:
        """One frame, as the records that carry it: header, then ciphertext + tag, for each record (separate
        pieces, to be written in order: joining them would copy every record once more)."""
        out: list[bytes] = []
        total = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
        if total == 0:
            return self._record(b"", LAST)
        pending: list[memoryview | bytes] = []
        pending_len = 0
        left = total
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while len(view):
                take = min(len(view), RECORD_BYTES - pending_len)
                pending.append(view[:take])
                pending_len += take
                view = view[take:]
                if pending_len == RECORD_BYTES or pending_len == left:
                    left -= pending_len
                    plain = pending[0] if len(pending) == 1 else b"".join(pending)
                    out += self._record(plain, LAST if left == 0 else 0)
                    pending, pending_len = [], 0
        return out

    def _record(self, plain: memoryview | bytes, flags: int) -> list[bytes]:
        header = RECORD_HEADER.pack(len(plain), flags)
        nonce = _nonce(self._count)
        self._count += 1
        return [header, self._aead.encrypt(nonce, plain, header)]


class Opener:
    """Decrypts the records of one direction, in order (one per link end)."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._count = 0

    @staticmethod
    def body_length(header: bytes) -> int:
        """How many bytes follow this record header (raises RecordRefused past RECORD_BYTES)."""
        length: int = RECORD_HEADER.unpack(header)[0]
        if length > RECORD_BYTES:
            raise RecordRefused(f"a record announced {length} bytes (at most {RECORD_BYTES}); the link is closed")
        return length + TAG_BYTES

    def open(self, header: bytes, body: bytes) -> tuple[bytes, bool]:
        """(the record's plaintext, whether it ends a frame); raises RecordRefused if its tag fails."""
        try:
            plain = self._aead.decrypt(_nonce(self._count), body, header)
        except InvalidTag:
            raise RecordRefused("a record failed its authentication tag (forged, altered, replayed or "
                                "reordered); the link is closed") from None
        self._count += 1
        return plain, bool(RECORD_HEADER.unpack(header)[1] & LAST)


def read_frame(read_exact: Callable[[int], bytes], opener: Opener, limit: int) -> bytes:
    """One whole frame from a blocking stream (`read_exact(n)` gives n bytes or raises), at most limit bytes."""
    frame = bytearray()
    while True:
        header = read_exact(RECORD_HEADER.size)
        plain, last = opener.open(header, read_exact(opener.body_length(header)))
        frame += plain
        if len(frame) > limit:
            raise RecordRefused(f"a frame grew past {limit} bytes")
        if last:
            return bytes(frame)
