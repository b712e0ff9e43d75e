"""The controller's end of the visual debugger in a rank: DAP requests out to the rank (through its
host's agent, to the rank's reader thread), their responses matched back to whoever waits, and the
rank's events handed to a listener (the notebook's debugger, `magics/debugger.py`).

Responses arrive on the loop thread; waits happen on any other (the kernel's control thread).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.state import MeshState
from monarch_kernel.wire.debugging import DebugFromRank, DebugToRank

EventListener = Callable[[int, int, dict[str, Any]], None]  # (session, rank, DAP event)


class RankDebugging:
    """DAP traffic with the debuggers in a mesh's ranks (one session per notebook debugger)."""

    sessions = itertools.count(1)  # (shared: a session names one notebook debugger's link to one rank)

    def __init__(self, state: MeshState, loop: ControllerLoop):
        self._state = state
        self._loop = loop
        self._lock = threading.Lock()
        self._waiting: dict[tuple[int, int, int], concurrent.futures.Future[dict[str, Any]]] = {}
        self.on_event: EventListener | None = None

    def request(self, session: int, rank: int, message: dict[str, Any]) -> concurrent.futures.Future[dict[str, Any]]:
        """Send one DAP request to `rank`'s debugger; the future holds its response."""
        answer: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        state = self._state.ranks.get(rank)
        if state is None or not state.alive:
            answer.set_exception(RuntimeError(f"rank {rank} is not running"))
            return answer
        with self._lock:
            self._waiting[(session, rank, int(message["seq"]))] = answer
        if message.get("command") == "disconnect":  # (its threads run on)
            state.paused_in_debugger = False
        text = json.dumps(message)
        self._loop.call(self._state.send_to_ranks, (rank,), lambda local: DebugToRank(local, session, text))
        return answer

    def forget(self, session: int, rank: int, seq: int) -> None:
        """Stop waiting for the response to request `seq` (it took too long)."""
        with self._lock:
            self._waiting.pop((session, rank, seq), None)

    def arrived(self, msg: DebugFromRank) -> None:
        """A rank's debugger said something (loop thread)."""
        message = json.loads(msg.dap)
        if message.get("type") == "response":
            with self._lock:
                answer = self._waiting.pop((msg.session, msg.rank, int(message.get("request_seq", -1))), None)
            if answer is not None and not answer.done():
                answer.set_result(message)
            return
        rank = self._state.ranks.get(msg.rank)
        if rank is not None and message.get("event") in ("stopped", "continued"):
            rank.paused_in_debugger = message["event"] == "stopped"
        listener = self.on_event
        if listener is not None:
            listener(msg.session, msg.rank, message)

    def paused(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Those of `ranks` with a thread stopped at a breakpoint now."""
        return tuple(r for r in ranks if (state := self._state.ranks.get(r)) is not None and state.paused_in_debugger)

    def rank_gone(self, rank: int, why: str) -> None:
        """A rank died or its host was lost: whoever waits for its debugger hears why."""
        if (state := self._state.ranks.get(rank)) is not None:
            state.paused_in_debugger = False
        with self._lock:
            gone = [key for key in self._waiting if key[1] == rank]
            answers = [self._waiting.pop(key) for key in gone]
        for answer in answers:
            if not answer.done():
                answer.set_exception(RuntimeError(why))
