"""Asking ranks where they are (`%mesh why`, `%mesh stacks`, a hang seen live), and hearing that a
stop had to end collectives in progress.

An inspection goes to each host's agent, which passes it to its ranks' reader threads; their
answers come back as they are made. `ask` waits for every rank it asked, at most `timeout`:
a rank whose main thread holds the GIL in a C call cannot answer, and is named as silent.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable

from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.state import MeshState
from monarch_kernel.core.hangs import RankReport
from monarch_kernel.wire.diagnosis import InspectRanks, RankInspection

ANSWER_WITHIN_S = 1.5  # a rank that answers later is stuck in a C call holding the GIL


class Inspections:
    """The inspections of one mesh in flight, by id (answers on the loop thread, waits on any other)."""

    _ids = itertools.count(1)

    def __init__(self, state: MeshState, loop: ControllerLoop):
        self._state = state
        self._loop = loop
        self._answers: dict[int, dict[int, RankReport]] = {}
        self._changed = threading.Condition()
        self.hang_after_s: float | None = 30.0  # a running cell with no progress this long shows why (None: never)

    def ask(self, ranks: Iterable[int], *, all_threads: bool = False, timeout: float = ANSWER_WITHIN_S,
            stacks_only: bool = False, counters_only: bool = False,
            ) -> tuple[dict[int, RankReport], dict[int, str], tuple[int, ...]]:
        """(reports, dead ranks and how they died, silent ranks) of these ranks, now."""
        state = self._state
        wanted = sorted(set(ranks))
        dead = {r: state.ranks[r].exit_text() for r in wanted if r in state.ranks and not state.ranks[r].alive}
        alive = frozenset(r for r in wanted if r not in dead and r in state.ranks)
        inspect_id = next(self._ids)
        with self._changed:
            self._answers[inspect_id] = {}
        if alive:
            self._loop.call(state.send_to_ranks, alive,
                            lambda local: InspectRanks(local, inspect_id, all_threads, stacks_only, counters_only))
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._answers[inspect_id]) < len(alive) and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            reports = self._answers.pop(inspect_id)
        silent = tuple(sorted(alive - set(reports)))
        return reports, dead, silent

    def answer(self, msg: RankInspection) -> None:
        """A rank's report came (loop thread)."""
        with self._changed:
            answers = self._answers.get(msg.inspect_id)
            if answers is not None:
                answers[msg.rank] = msg.report
                self._changed.notify_all()
