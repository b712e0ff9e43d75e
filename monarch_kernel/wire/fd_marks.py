"""How far a local rank's fd output has been passed on: a page the agent writes, the rank reads.

The agent reads what a rank writes to its file descriptors 1 and 2 and passes it to the
controller, stamping each piece with the rank's running byte count. A request the notebook
sent on the rank's lane answers on that lane, around the agent; so that its result cannot
overtake the last lines its C code wrote, the rank reads the count from this page once its
pipes are empty and puts it in the result, and the controller books the result only after
it has seen that much fd output (see controller/requests.py).

The page holds two little-endian u64: a sequence number, odd while the agent is between
reading a pipe and counting what it passed on, and the count.
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import struct
import termios
import time

PAGE = struct.Struct("<QQ")
DRAIN_S = 0.05  # how long a result waits for the agent to take the rank's fd output


def fd_mark_path(shm_dir: str, rank: int) -> str:
    """The page of one rank in the mesh's private shared-memory folder."""
    return os.path.join(shm_dir, f"fdmark-{rank}")


class FdMarkWriter:
    """The agent's side: one page per local rank, made fresh when the rank starts."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, PAGE.size)
            self._map = mmap.mmap(fd, PAGE.size)
        finally:
            os.close(fd)
        self._seq = 0
        self.count = 0

    def reading(self) -> None:
        """About to read a pipe: readers wait until `passed_on`."""
        self._seq += 1
        PAGE.pack_into(self._map, 0, self._seq, self.count)

    def passed_on(self, nbytes: int) -> int:
        """What was read has been sent on; returns the new count."""
        self._seq += 1
        self.count += nbytes
        PAGE.pack_into(self._map, 0, self._seq, self.count)
        return self.count

    def close(self) -> None:
        """Unmap the page."""
        self._map.close()


class FdMarkReader:
    """The rank's side (its fast path, run after every request, is two ioctls and two reads
    of the page)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, PAGE.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._waiting = (array.array("i", [0]), array.array("i", [0]))

    def mark(self, timeout: float = DRAIN_S) -> int:
        """The agent's count once nothing this process wrote to fd 1/2 is waiting for it
        (0 if that takes longer than timeout: the result then does not wait)."""
        deadline = None
        while True:
            seq, count = PAGE.unpack_from(self._map, 0)
            if not seq % 2 and not self._pending() and PAGE.unpack_from(self._map, 0)[0] == seq:
                return int(count)
            if deadline is None:
                deadline = time.monotonic() + timeout
            elif time.monotonic() > deadline:
                return 0
            time.sleep(0.0002)

    def _pending(self) -> int:
        """Bytes written to fd 1 and 2 that the agent has not read yet (a closed or odd fd, if the
        user's code closed one, counts nothing)."""
        total = 0
        for fd, waiting in zip((1, 2), self._waiting):
            try:
                fcntl.ioctl(fd, termios.FIONREAD, waiting, True)
                total += waiting[0]
            except OSError:
                pass
        return total
