"""What the actors of a rank run now, as its heartbeat tells the agent ("Trainer.step 1.5s")."""

from __future__ import annotations

import time
from collections.abc import Callable

from monarch_kernel.wire.calls import CallKey


class EndpointActivity:
    """The endpoints running on a rank (any thread), and what the agent was last told of them."""

    def __init__(self) -> None:
        self._doing: dict[CallKey, tuple[str, float]] = {}  # call -> (endpoint label, start time)
        self.reported = ""  # the activity last told to the agent
        self.on_idle: Callable[[], None] | None = None  # tells the agent, when set

    def started(self, key: CallKey, label: str) -> None:
        """Call `key` runs endpoint `label` from now."""
        self._doing[key] = (label, time.monotonic())

    def ended(self, key: CallKey) -> None:
        """Call `key` ended: if the agent was told the rank is busy and it is no longer, say so now."""
        self._doing.pop(key, None)
        if self.reported and not self._doing and self.on_idle is not None:
            self.on_idle()

    def describe(self) -> str:
        """The oldest endpoint running and for how long, with how many more ("" when idle); what the
        heartbeat thread returns is what the agent believes."""
        doing = list(self._doing.values())
        if not doing:
            self.reported = ""
            return ""
        label, started = min(doing, key=lambda d: d[1])
        more = f" (+{len(doing) - 1})" if len(doing) > 1 else ""
        self.reported = f"{label}{more} {time.monotonic() - started:.1f}s"
        return self.reported
