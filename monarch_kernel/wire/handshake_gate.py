"""Bounds for a listener that anyone on the network can reach: connections that have not proved a key yet.

Our long-lived listeners (a rank's far-call listener, a Slurm node's persistent-mesh port, a relay
parent's port) accept before they know who connects. Without bounds, a crowd of silent connections
holds descriptors until the process runs out (user code then fails to open files) and floods the
notebook with refusal lines. The gate keeps at most MAX_PENDING connections in their handshake, at
most MAX_PENDING_PER_SOURCE from one address, and drops the oldest past either cap (never the
newcomer: it may be the peer that holds the key); whoever is dropped or refused is counted, and one
summary line per LOG_WINDOW_S says how many and why. Listeners use a short accept backlog
(ACCEPT_BACKLOG): asyncio accepts that many connections per turn of the loop before their handlers (and
so the gate) run, which bounds the burst too. `raise_descriptor_limit` lifts the soft
descriptor limit to the hard one, as agents and ranks start.
"""

from __future__ import annotations

import asyncio
import collections
import resource
import time
from collections.abc import Callable

ACCEPT_BACKLOG = 16  # a listener's backlog: asyncio accepts up to this many at once, before the gate sees them
MAX_PENDING = 64
MAX_PENDING_PER_SOURCE = 8
LOG_WINDOW_S = 60.0


class HandshakeGate:
    """One listener's connections in their handshake (see the module's note); used on its event loop."""

    def __init__(self, what: str, log: Callable[[str], None], *, max_pending: int = MAX_PENDING,
                 per_source: int = MAX_PENDING_PER_SOURCE, window: float = LOG_WINDOW_S):
        self._what = what
        self._log = log
        self._max = max_pending
        self._per_source = per_source
        self._window = window
        self._pending: collections.OrderedDict[int, tuple[str, asyncio.StreamWriter]] = collections.OrderedDict()
        self._counted = 0  # refused or dropped since the last summary
        self._why = ""
        self._logged_at: float | None = None
        self._later: asyncio.TimerHandle | None = None
        self.refused = 0  # in all

    def admit(self, writer: asyncio.StreamWriter) -> int:
        """Register a new connection (dropping the oldest past the caps); its token for `done`/`refuse`."""
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        same = [key for key, (src, _) in self._pending.items() if src == source]
        while len(same) >= self._per_source:
            self._drop(same.pop(0), f"more than {self._per_source} connections from {source} in their handshake")
        while len(self._pending) >= self._max:
            self._drop(next(iter(self._pending)), f"more than {self._max} connections in their handshake")
        token = id(writer)
        self._pending[token] = (source, writer)
        return token

    def done(self, token: int) -> None:
        """The connection's handshake ended (proved, or refused)."""
        self._pending.pop(token, None)

    def refuse(self, token: int, why: str) -> None:
        """The connection failed its handshake: close it, count it, and summarize now and then."""
        entry = self._pending.pop(token, None)
        if entry is not None:
            entry[1].close()
            self._count(f"{entry[0]}: {why}")

    def _drop(self, token: int, why: str) -> None:
        source, writer = self._pending.pop(token)
        writer.close()  # (its handshake then fails at once and ends through `refuse`, which finds it gone)
        self._count(f"{source}: {why}")

    def _count(self, why: str) -> None:
        self.refused += 1
        self._counted += 1
        self._why = why
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= self._window:
            self._summarize()
        elif self._later is None:  # the rest of this window's refusals: one line when it ends
            self._later = asyncio.get_running_loop().call_later(self._logged_at + self._window - now, self._summarize)

    def _summarize(self) -> None:
        self._later = None
        if not self._counted:
            return
        self._logged_at, count, self._counted = time.monotonic(), self._counted, 0
        self._log(f"{self._what} refused {count} connection(s) that did not prove the key"
                  + (f" in the last {self._window:.0f} s" if count > 1 else "") + f" (last: {self._why})")

    def close(self) -> None:
        """The listener closed: say what is still counted, and close the connections still in their handshake."""
        if self._later is not None:
            self._later.cancel()
        self._summarize()
        for _, writer in self._pending.values():
            writer.close()
        self._pending.clear()


def raise_descriptor_limit() -> None:
    """Lift the soft limit on open descriptors to the hard limit (the usual 1024 runs out under load)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):
        pass
