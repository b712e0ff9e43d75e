"""Mutual proof of a shared secret on a fresh connection (the direct link to a Slurm node's agent, a persistent mesh's socket).

Both ends hold a secret that travelled on an already authenticated channel (the job
step's stdin). Neither end sends it: each proves knowledge with an HMAC over both
sides' random nonces, so a recorded exchange proves nothing the next time.

    agent -> controller   nonce_a
    controller -> agent   nonce_c, HMAC(secret, "controller" | nonce_a | nonce_c)
    agent -> controller   HMAC(secret, "agent" | nonce_c | nonce_a)
    session key = HMAC(secret, "session" | nonce_a | nonce_c)

The proof alone would not bind the connection: a local user who relays the handshake
between the two ends (it can take the port on an address the agent did not bind) would be
trusted by both afterwards. So every later frame is sealed under the session key, with a
direction and a sequence number (`wire.relay_link.RelayLink`): a relaying peer can read the
frames but not forge, alter, replay or reorder one. Frames are not encrypted (like gloo and
NCCL traffic).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket

SECRET_BYTES = 32
_NONCE = 32
_MAC = hashlib.sha256().digest_size


class AuthenticationFailed(ConnectionError):
    """The other end did not prove that it holds the secret."""


def new_secret() -> bytes:
    """A fresh random secret for one agent's direct link."""
    return os.urandom(SECRET_BYTES)


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthenticationFailed("the other end closed the connection during the handshake")
        data += chunk
    return bytes(data)


def prove_controller(sock: socket.socket, secret: bytes, timeout: float = 5.0) -> bytes:
    """Controller's side: prove the secret, and check the agent's proof; the session key
    (raises AuthenticationFailed)."""
    sock.settimeout(timeout)
    nonce_a = _recv_exact(sock, _NONCE)
    nonce_c = os.urandom(_NONCE)
    sock.sendall(nonce_c + _mac(secret, b"controller", nonce_a, nonce_c))
    if not hmac.compare_digest(_recv_exact(sock, _MAC), _mac(secret, b"agent", nonce_c, nonce_a)):
        raise AuthenticationFailed("the agent's proof of the secret is wrong")
    sock.settimeout(None)
    return _mac(secret, b"session", nonce_a, nonce_c)


def check_controller(sock: socket.socket, secret: bytes, timeout: float = 5.0) -> bytes:
    """Agent's side: check the controller's proof, then prove the secret; the session key
    (raises AuthenticationFailed)."""
    sock.settimeout(timeout)
    nonce_a = os.urandom(_NONCE)
    sock.sendall(nonce_a)
    answer = _recv_exact(sock, _NONCE + _MAC)
    nonce_c, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"controller", nonce_a, nonce_c)):
        raise AuthenticationFailed("the connecting peer did not prove the secret")
    sock.sendall(_mac(secret, b"agent", nonce_c, nonce_a))
    sock.settimeout(None)
    return _mac(secret, b"session", nonce_a, nonce_c)


async def _read_exact(reader: asyncio.StreamReader, n: int, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        raise AuthenticationFailed(f"the handshake did not complete ({type(exc).__name__})") from None


async def prove_controller_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                                 timeout: float = 5.0) -> bytes:
    """`prove_controller` on asyncio streams (a persistent mesh's Unix socket)."""
    nonce_a = await _read_exact(reader, _NONCE, timeout)
    nonce_c = os.urandom(_NONCE)
    writer.write(nonce_c + _mac(secret, b"controller", nonce_a, nonce_c))
    await writer.drain()
    if not hmac.compare_digest(await _read_exact(reader, _MAC, timeout), _mac(secret, b"agent", nonce_c, nonce_a)):
        raise AuthenticationFailed("the agent's proof of the secret is wrong")
    return _mac(secret, b"session", nonce_a, nonce_c)


async def check_controller_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                                 timeout: float = 5.0) -> bytes:
    """`check_controller` on asyncio streams."""
    nonce_a = os.urandom(_NONCE)
    writer.write(nonce_a)
    await writer.drain()
    answer = await _read_exact(reader, _NONCE + _MAC, timeout)
    nonce_c, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"controller", nonce_a, nonce_c)):
        raise AuthenticationFailed("the connecting peer did not prove the secret")
    writer.write(_mac(secret, b"agent", nonce_c, nonce_a))
    await writer.drain()
    return _mac(secret, b"session", nonce_a, nonce_c)
