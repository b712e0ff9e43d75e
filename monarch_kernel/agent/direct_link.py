"""The agent's offer of a direct TCP link to the controller (Slurm nodes: srun's stdio is slow for bulk data).

Over the job step's stdin the controller sends a secret (never on a command line or in
an environment); the agent listens on the node's address, says the port on stdout, and
accepts the first connection that proves the secret (`direct_auth`). Then the listener
closes: no port of ours stays open. If the controller cannot connect it says `stdio` on
stdin and the protocol stays on the step's pipes.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time

from monarch_kernel.wire.direct_auth import AuthenticationFailed, check_controller

OFFER_WAIT_S = 120.0  # the controller answers within its own connect timeout; this bounds a wedged one
MAX_FAILED_PROOFS = 16  # strangers knocking: end the agent (its log says why) rather than listen on


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


def offer(read_fd: int, write_fd: int, address: str, secret: bytes) -> socket.socket | None:
    """The authenticated connected socket, or None to speak on the pipes."""
    try:
        listener = socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
    except OSError as exc:
        _log(f"cannot listen on {address} ({exc}); staying on the step's stdio")
        os.write(write_fd, b"direct none\n")
        return None
    with listener:
        os.write(write_fd, f"direct {listener.getsockname()[1]}\n".encode())
        deadline, failures = time.monotonic() + OFFER_WAIT_S, 0
        while failures < MAX_FAILED_PROOFS:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit("monarch_kernel agent: the controller neither connected nor chose stdio")
            ready, _, _ = select.select([listener.fileno(), read_fd], [], [], left)
            if read_fd in ready:
                answer = read_line(read_fd)
                if answer.strip() == b"stdio" or not answer:
                    if not answer:
                        raise SystemExit("monarch_kernel agent: the controller went away before connecting")
                    _log("the controller could not connect; staying on the step's stdio")
                    return None
            if listener.fileno() in ready:
                conn, peer = listener.accept()
                try:
                    check_controller(conn, secret)
                except (AuthenticationFailed, OSError) as exc:
                    failures += 1
                    _log(f"refused a connection from {peer[0]}: {exc}")
                    conn.close()
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
    raise SystemExit(f"monarch_kernel agent: {MAX_FAILED_PROOFS} connections to the direct link failed to prove "
                     "the secret; someone else is knocking on this node's ports (start with direct=False / --no-direct)")
