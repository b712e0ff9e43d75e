"""The lanes of one async actor: other meshes' ranks on this machine call it there, on its own loop.

A call from another mesh's rank on this machine comes by a direct lane (`rank/direct_calls.py`). On
the rank's lane it is read by the rank's loop, which then hands an async actor's call to that
actor's own loop (`rank/actor_loops.py`): one thread switch more per call than when async actors
shared the rank's loop. So an async actor listens too, at `wire.lanes.actor_lane_path`, and its own
loop reads the calls that come there and starts them at once: the caller's thread writes, the
actor's loop reads, runs and answers. Each caller puts all its calls to one actor on one lane, so
they arrive in the order it made them; a caller that finds no such lane (a sync actor's, or one
that ended) uses the rank's.

The lanes are as private as the rank's (a mode-0700 folder, our own user only: `wire/lanes.py`).
When the actor ends, its loop stops listening and, as it ends, hands each lane to the rank's loop and
tells its caller (`LaneRetired`): the caller makes no new call there, and closes the lane once every
call it sent there was answered. A call that was on its way meanwhile is read and answered by the
rank (the actor is gone: it says so), never lost and never taken for the rank's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.rank.actor_loops import ActorLoop
from monarch_kernel.wire.lane_server import LaneServer, accept_lane, listen_lane
from monarch_kernel.wire.messages import LaneRetired

OnLaneMessage = Callable[[Any, Callable[[Any], None]], None]  # (message, the lane's send for its answer)
RankLoop = Callable[[], tuple[asyncio.AbstractEventLoop | None, int]]  # (the rank's loop, its thread)


class ActorLanes:
    """Where one async actor listens, and the lanes it serves, all on its own loop."""

    def __init__(self, path: str, own_loop: ActorLoop, on_message: OnLaneMessage, rank_loop: RankLoop) -> None:
        self._path = path
        self._loop = own_loop.loop
        self._on_message = on_message
        self._rank_loop = rank_loop
        self._listener: socket.socket | None = listen_lane(path)  # (now: a caller may connect before it is served)
        self._inode = os.stat(path).st_ino  # (the path is unlinked at the end only while it is still this socket)
        self._servers: list[LaneServer] = []
        own_loop.at_end.append(self.retire)
        self._loop.call_soon_threadsafe(self._serve)

    def _serve(self) -> None:
        if self._listener is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _accept(self) -> bool:
        """Serve the next caller that connected: False when none waits."""
        if self._listener is None or (sock := accept_lane(self._listener)) is None:
            return False
        self._servers = [server for server in self._servers if not server.closed]
        reply: list[Callable[[Any], None]] = []  # the new lane's send, bound once
        server = LaneServer(sock, self._loop, lambda msg: self._on_message(msg, reply[0]))  # (also as it ends)
        reply.append(server.send)
        self._servers.append(server)
        return True

    def retire(self) -> None:
        """Stop listening; the lanes go to the rank's loop, their callers told (on the actor's loop, as it ends)."""
        while self._accept():  # (a caller that connected and was not served yet is served and told too)
            pass
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(ValueError, OSError):  # (never served: its loop ended first)
                self._loop.remove_reader(listener.fileno())
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self._path).st_ino == self._inode:
                    os.unlink(self._path)
        rank_loop, rank_thread = self._rank_loop()
        for server in self._servers:
            if server.closed:
                continue
            with contextlib.suppress(ConnectionClosed):
                server.send(LaneRetired())
            if rank_loop is None or rank_loop.is_closed():  # (the rank is ending: nothing will be answered)
                server.close()
            else:
                server.move_to(rank_loop, rank_thread)
        self._servers.clear()
