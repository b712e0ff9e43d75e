"""What the actors of a rank run now, as its heartbeat tells the agent ("Trainer.step 1.5s")."""

from __future__ import annotations

import time
from collections.abc import Callable

from monarch_kernel.rank.runs import Run, Runs


class EndpointActivity:
    """The endpoints running on a rank (its runs that are actor calls), and what the agent was last told."""

    def __init__(self, runs: Runs) -> None:
        self._runs = runs
        self.reported = ""  # the activity last told to the agent
        self.on_idle: Callable[[], None] | None = None  # tells the agent, when set
        runs.on_ended = self._ended

    def _ended(self, run: Run) -> None:
        """A run ended: if the agent was told the rank is busy with endpoints and it is no longer, say so now."""
        if run.actor is not None and self.reported and self.on_idle is not None and not self._runs.calls():
            self.on_idle()

    def describe(self) -> str:
        """The oldest endpoint running and for how long, with how many more ("" when idle); what the
        heartbeat thread returns is what the agent believes."""
        calls = self._runs.calls()
        if not calls:
            self.reported = ""
            return ""
        oldest = calls[0]
        more = f" (+{len(calls) - 1})" if len(calls) > 1 else ""
        self.reported = f"{oldest.label}{more} {time.monotonic() - oldest.started:.1f}s"
        return self.reported
