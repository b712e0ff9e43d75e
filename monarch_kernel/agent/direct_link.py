"""The agent's offer of a direct TCP link to the controller (Slurm nodes: srun's stdio is slow for bulk data).

Over the job step's stdin the controller sends a secret (never on a command line or in
an environment); the agent listens on the node's numeric address, says it and the port on
stdout, and accepts the first connection that proves the secret (`direct_auth`), whose
frames are then sealed under the handshake's session key. Then the listener closes: no port
of ours stays open. If the controller cannot connect it says `stdio` on
stdin and the protocol stays on the step's pipes.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import sys
import threading
import time

from monarch_kernel.core.addresses import numeric_address
from monarch_kernel.wire.direct_auth import AuthenticationFailed, check_controller

OFFER_WAIT_S = 120.0  # the controller answers within its own connect timeout; this bounds a wedged one
HANDSHAKE_S = 2.0  # each connection proves the secret within this (checked concurrently)
MAX_CHECKING = 32  # connections being checked at once; more are refused at once


def read_line(fd: int, limit: int = 1 << 16) -> bytes:
    """One line from fd, a byte at a time (what follows belongs to the framed protocol); b"" at EOF."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return b""
        line += byte
        if len(line) > limit:
            raise SystemExit("monarch_kernel agent: a line on stdin is too long")
    return bytes(line)


def read_secret(fd: int) -> bytes:
    """The direct link's secret: one hex line on stdin."""
    try:
        secret = bytes.fromhex(read_line(fd, limit=256).decode().strip())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise SystemExit("monarch_kernel agent: --direct needs a secret of 16 bytes or more on stdin (hex line)")
    return secret


def _log(text: str) -> None:
    print(f"monarch_kernel agent: {text}", file=sys.stderr, flush=True)


def offer(read_fd: int, write_fd: int, address: str, secret: bytes) -> tuple[socket.socket, bytes] | None:
    """The authenticated connected socket and its session key, or None to speak on the pipes.

    The address is resolved once, here, and the listener binds that numeric address and says
    it (`direct IP PORT`): the controller connects to that literal only, so nobody can take the
    port on another address the name might resolve to. Connections are checked concurrently,
    each within HANDSHAKE_S: strangers knocking (or one that stays silent) neither delay the
    controller nor end the agent; they are refused and logged until the controller joins or
    the offer's time is up.
    """
    try:
        numeric = numeric_address(address)
        listener = socket.create_server((numeric, 0), family=socket.AF_INET6 if ":" in numeric else socket.AF_INET)
    except OSError as exc:
        _log(f"cannot listen on {address} ({exc}); staying on the step's stdio")
        os.write(write_fd, b"direct none\n")
        return None
    wake_r, wake_w = socket.socketpair()
    joined: queue.SimpleQueue[tuple[socket.socket, bytes]] = queue.SimpleQueue()
    checking = threading.BoundedSemaphore(MAX_CHECKING)
    with listener, wake_r, wake_w:
        os.write(write_fd, f"direct {numeric} {listener.getsockname()[1]}\n".encode())
        deadline = time.monotonic() + OFFER_WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit("monarch_kernel agent: the controller neither connected nor chose stdio")
            ready, _, _ = select.select([listener.fileno(), read_fd, wake_r.fileno()], [], [], left)
            if wake_r.fileno() in ready:
                wake_r.recv(64)
                try:
                    return joined.get_nowait()
                except queue.Empty:
                    pass
            if read_fd in ready:
                answer = read_line(read_fd)
                if not answer:
                    raise SystemExit("monarch_kernel agent: the controller went away before connecting")
                if answer.strip() == b"stdio":
                    _log("the controller could not connect; staying on the step's stdio")
                    return None
            if listener.fileno() in ready:
                conn, peer = listener.accept()
                if not checking.acquire(blocking=False):
                    _log(f"refused a connection from {peer[0]}: {MAX_CHECKING} others are being checked")
                    conn.close()
                    continue
                threading.Thread(target=_check, args=(conn, peer, secret, joined, wake_w, checking),
                                 name="direct-link-check", daemon=True).start()


def _check(conn: socket.socket, peer: tuple[str, int], secret: bytes, joined: queue.SimpleQueue[tuple[socket.socket, bytes]],
           wake: socket.socket, checking: threading.BoundedSemaphore) -> None:
    """Check one connection's proof (a thread each: a silent stranger delays nobody)."""
    try:
        session = check_controller(conn, secret, timeout=HANDSHAKE_S)
    except (AuthenticationFailed, OSError) as exc:
        _log(f"refused a connection from {peer[0]}: {exc}")
        conn.close()
        return
    finally:
        checking.release()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    joined.put((conn, session))
    try:
        wake.send(b"!")
    except OSError:  # the offer ended meanwhile (another connection won)
        conn.close()
