"""Hearing from hosts: the controller pings every agent, notes when a host goes quiet and when it
is heard again, and gives a host up after `host_lost_after_s` of silence (loop thread only).

Bytes moving on a link count as life even when no message completed (a large frame coming
in, or the agent taking part of what was queued for it), and a tick that comes late because
this loop itself stalled (the kernel held the GIL in a C call) judges nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from monarch_kernel.controller.state import HostLink, MeshSpec, MeshState
from monarch_kernel.wire import messages as m


class HostHearing:
    """Pings and silences of one mesh's hosts."""

    def __init__(self, state: MeshState, spec: MeshSpec, clock: Callable[[], float],
                 on_lost: Callable[[HostLink, Exception | None], None], notice: Callable[[str], None]):
        self._state = state
        self._spec = spec
        self._clock = clock  # what "now" is when judging a host's silence
        self._on_lost = on_lost  # a host is given up
        self._notice = notice  # a line for the notebook

    async def ping_hosts(self) -> None:
        """Ping every agent regularly; a host silent for host_lost_after_s is lost."""
        seq = 0
        interval = self._spec.health.ping_interval_s
        loop = asyncio.get_running_loop()
        last_tick = loop.time()
        while not self._state.closed:
            await asyncio.sleep(interval)
            seq += 1
            now = self._clock()
            if loop.time() - last_tick > 2 * interval + 0.5:
                # this loop itself was stalled (the kernel held the GIL in a C call): the
                # agents' answers are still unread, so their silence says nothing yet
                for link in self._state.links:
                    link.last_pong = max(link.last_pong, now)
            last_tick = loop.time()
            for link in self._state.links:
                if not link.is_open:
                    continue
                if made_progress(link):
                    link.last_pong = max(link.last_pong, now)
                silent = now - link.last_pong
                if link.answered and silent > self._spec.health.host_lost_after_s:
                    self._on_lost(link, TimeoutError(f"no heartbeat for {silent:.1f} s"))
                    link.close()
                    continue
                self.note_reachability(link, silent)
                link.send(m.Ping(seq))

    def note_reachability(self, link: HostLink, silent: float) -> None:
        """Say once when a host goes quiet (its ranks and link are kept) and when it is heard again."""
        health = self._spec.health
        quiet = link.answered and silent > min(health.host_unreachable_after_s, health.host_lost_after_s)
        if quiet and not link.unreachable:
            link.unreachable = True
            self._notice(f"mesh {self._spec.name!r}: host {link.name} has not answered for {silent:.1f} s: "
                         f"unreachable; its ranks are kept, and it is given up after "
                         f"{health.host_lost_after_s:.0f} s of silence\n")
        elif not quiet and link.unreachable:
            link.unreachable = False
            self._notice(f"mesh {self._spec.name!r}: host {link.name} answers again\n")


def made_progress(link: HostLink) -> bool:
    """Whether bytes moved on the link since the last ping tick, though no message completed.

    Part of a large frame arrived (a pull), or the peer took part of what we queued for it (a
    push): either way the host is alive, and its pong may simply be queued behind those bytes,
    here or on its side (an oversubscribed machine, or a slow link). A cut link moves nothing.
    """
    if link.conn is None:
        return False
    received, backlog = link.conn.last_received, link.conn.backlog()
    moved = (link.last_bytes is not None and received != link.last_bytes) or backlog < link.last_backlog
    link.last_bytes, link.last_backlog = received, backlog
    return moved
