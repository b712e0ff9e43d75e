"""Direct lanes: a Unix socket from the notebook's process straight to a local rank.

Actor calls from the notebook to ranks on this machine skip the controller thread and
the host agent: the calling thread writes the frame to the rank's lane, the rank
answers on it. Each rank listens at `<private dir>/rank-N.sock`; the folder is mode
0700, and both ends check that the other runs as our own user (SO_PEERCRED), so only
this user's processes can reach a lane. Lanes exist only on one machine; ranks on SSH
hosts are reached through their host agent. The rank's end is `lane_server`, the
notebook's `lane_client`; this module holds what both use.

An async actor (one with an event loop of its own) also listens, at `actor_lane_path`: other
meshes' ranks on this machine call it there, and its own loop reads their calls (no trip through
the rank's loop, `rank/actor_lanes.py`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from collections.abc import Callable

from monarch_kernel.core.interrupt_shield import shielded
from monarch_kernel.wire.transport import FrameProtocol

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def lane_path(private_dir: str, rank: int) -> str:
    """Where rank `rank` listens."""
    return os.path.join(private_dir, f"rank-{rank}.sock")


def actor_lane_path(private_dir: str, rank: int, actor_key: str) -> str:
    """Where the async actor of spawn `actor_key` on rank `rank` listens (a digest of the key keeps the
    path short: a Unix socket's path holds at most 107 bytes)."""
    digest = hashlib.blake2b(actor_key.encode(), digest_size=8).hexdigest()
    return os.path.join(private_dir, f"rank-{rank}-{digest}.sock")


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return int(pid), int(uid)


def peer_is_us(sock: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as our own user."""
    return peer_credentials(sock)[1] == os.getuid()


def read_available(sock: socket.socket, reader: FrameProtocol, lost: Callable[[Exception | None], None],
                   closed: Callable[[], bool]) -> None:
    """Feed the bytes waiting on a non-blocking socket to a frame reader, until a read comes
    back short (the socket was empty then: what comes later wakes the caller's select again,
    and a read that would only say "nothing more" is saved)."""
    def read_all() -> None:
        while not closed() and _read_once(sock, reader, lost):
            pass

    shielded(read_all)  # (non-blocking: it ends when the socket is empty)


def _read_once(sock: socket.socket, reader: FrameProtocol, lost: Callable[[Exception | None], None]) -> bool:
    """One read, and the reader told of it (one step a stop cannot split); False when the socket is empty,
    or the lane was lost."""
    buf = reader.get_buffer(-1)
    try:
        n = sock.recv_into(buf)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as exc:
        lost(exc)
        return False
    if n == 0:
        lost(None)
        return False
    reader.buffer_updated(n)
    return n == len(buf)
