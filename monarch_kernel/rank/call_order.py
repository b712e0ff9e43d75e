"""The notebook is one sender: an actor call it sends after a request (a cell, a pull) waits for
that request to end on the rank, as each sender's order promises. Calls from ranks and other
meshes do not wait: actors serve them beside a running cell. A cell that waits on actor calls
itself lets the notebook's held calls go meanwhile (what it waits on may be among them)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from monarch_kernel.wire.actor_messages import CONTROLLER
from monarch_kernel.wire.messages import ActorCall


class BehindRequests:
    """The notebook's requests not yet ended on this rank, and its calls held behind them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0  # given to the main thread and not ended
        self.running = False  # the main thread runs a request now
        self._waiting = False  # the request running now waits on actor calls
        self._held: deque[tuple[ActorCall, Any]] = deque()  # (call, reply route): held on the loop thread

    def request_queued(self) -> None:
        """A request of the notebook was given to the main thread."""
        with self._lock:
            self._requests += 1

    def request_runs(self, running: bool) -> bool:
        """The main thread starts a request (True) or ends it (False). True when calls are held behind it: the
        loop thread must release them (most requests have none, and then the loop is not woken at all)."""
        self.running = running
        if running:
            return False
        with self._lock:  # (a call held from now on sees this request ended: it is not held)
            self._requests -= 1
            return bool(self._held)

    def request_waits(self, waiting: bool) -> None:
        """The request running now waits on actor calls (True), or no longer (False)."""
        self._waiting = waiting

    def _blocked(self) -> bool:  # (with _lock held)
        return self._requests > 0 and not self._waiting

    def hold(self, msg: ActorCall, reply_via: Any) -> bool:
        """Hold a call of the notebook that must wait for its requests (loop thread): True if held."""
        if msg.caller != CONTROLLER:
            return False
        with self._lock:  # (decided and held in one step: a request ending meanwhile sees it held)
            if not (self._held or self._blocked()):
                return False
            self._held.append((msg, reply_via))
            return True

    def release(self) -> list[tuple[ActorCall, Any]]:
        """The held calls that may go now, in order (loop thread)."""
        with self._lock:
            if not self._held or self._blocked():
                return []
            released = list(self._held)
            self._held.clear()
            return released
