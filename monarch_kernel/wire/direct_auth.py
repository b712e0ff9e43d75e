"""Mutual proof of a persistent mesh's secret on a fresh connection, with an ephemeral key exchange.

A persistent mesh's agent waits for the next kernel on a socket (a Unix socket in a private
folder; on a Slurm node, a TCP port on the node's address). Both ends hold the mesh's secret,
which travelled only on encrypted channels (SSH, the munge-keyed step link, a 0600 record on the
kernel's machine). Neither end sends it: each proves it with an HMAC over a transcript of fresh
X25519 public keys, and the session's keys come from the X25519 exchange, so a recording of the
connection reveals nothing, even to someone who learns the secret later:

    agent -> controller   X_a
    controller -> agent   X_c, HMAC(secret, "controller" | T)
    agent -> controller   HMAC(secret, "agent" | T)
    T = SHA256(X_a | X_c);  keys = HKDF(X25519, salt = HMAC(secret, "session" | T), T)

Every later frame is an AES-GCM record (`wire.relay_link.RelayLink`): a relaying peer can neither
read nor forge, alter, replay or reorder one.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os

from monarch_kernel.wire.link_crypto import (
    PUBLIC_BYTES,
    Ephemeral,
    RecordRefused,
    Session,
    keyed_session,
    proof,
    transcript_hash,
)

SECRET_BYTES = 32
_MAC = hashlib.sha256().digest_size
_LABEL = b"monarch-kernel persist link v2"


class AuthenticationFailed(ConnectionError):
    """The other end did not prove that it holds the secret."""


def new_secret() -> bytes:
    """A fresh random secret for one persistent mesh."""
    return os.urandom(SECRET_BYTES)


def _session(secret: bytes, ours: Ephemeral, theirs: bytes, transcript: bytes) -> Session:
    try:
        return keyed_session(secret, ours, theirs, transcript, _LABEL)
    except RecordRefused as exc:
        raise AuthenticationFailed(str(exc)) from None


async def _read_exact(reader: asyncio.StreamReader, n: int, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        raise AuthenticationFailed(f"the handshake did not complete ({type(exc).__name__})") from None


async def prove_controller_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                                 timeout: float = 5.0) -> Session:
    """The kernel's side: exchange keys, prove the secret, check the agent's proof; the session's keys
    (raises AuthenticationFailed)."""
    theirs = await _read_exact(reader, PUBLIC_BYTES, timeout)
    ours = Ephemeral()
    transcript = transcript_hash(theirs, ours.public)
    writer.write(ours.public + proof(secret, b"controller", transcript))
    await writer.drain()
    if not hmac.compare_digest(await _read_exact(reader, _MAC, timeout), proof(secret, b"agent", transcript)):
        raise AuthenticationFailed("the agent's proof of the secret is wrong")
    return _session(secret, ours, theirs, transcript)


async def check_controller_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                                 timeout: float = 5.0) -> Session:
    """The agent's side: check the kernel's proof, then prove the secret; the session's keys."""
    ours = Ephemeral()
    writer.write(ours.public)
    await writer.drain()
    answer = await _read_exact(reader, PUBLIC_BYTES + _MAC, timeout)
    theirs, kernel_proof = answer[:PUBLIC_BYTES], answer[PUBLIC_BYTES:]
    transcript = transcript_hash(ours.public, theirs)
    if not hmac.compare_digest(kernel_proof, proof(secret, b"controller", transcript)):
        raise AuthenticationFailed("the connecting peer did not prove the secret")
    writer.write(proof(secret, b"agent", transcript))
    await writer.drain()
    return _session(secret, ours, theirs, transcript)
