"""SIGINT to the rank's main thread, sent again until its handler has seen it.

On CPython before 3.13, a signal that reaches the main thread while it waits for the GIL
can stay unhandled until the main thread next returns from a blocking call: the thread
that holds the GIL recomputes the interpreter's "something to do" flag without the signal
(only the main thread may handle signals). The main thread then walks into a
`time.sleep(30)` or a collective's wait with the signal pending, and a stop waits for the
wait to end. Measured here: 1 stop in about 40 reached a sleeping endpoint only after it
ended. So an interrupt is re-sent, every few milliseconds, until the handler counts it
(or until it is no longer wanted: the code it was meant for ended).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

RESEND_EVERY_S = 0.05
GIVE_UP_AFTER_S = 5.0


class MainThreadInterrupts:
    """Sends SIGINT to the main thread until `seen()` (called by the rank's handler) counts it."""

    def __init__(self) -> None:
        self._seen = 0
        self._lock = threading.Lock()  # a check and a send are one step against a handler counting
        self.handler: Any = None  # the rank's SIGINT handler: another one (the user's) is sent to once

    def seen(self) -> None:
        """The SIGINT handler ran (first thing it does)."""
        with self._lock:
            self._seen += 1

    def interrupt(self, still_wanted: Callable[[], bool]) -> None:
        """SIGINT the main thread now, and again while the handler has not run and still_wanted()."""
        with self._lock:
            seen = self._seen
            _sigint_main()
        threading.Thread(target=self._follow_up, args=(seen, still_wanted), name="interrupt-follow-up",
                         daemon=True).start()

    def _follow_up(self, seen: int, still_wanted: Callable[[], bool]) -> None:
        waited = threading.Event()
        for _ in range(int(GIVE_UP_AFTER_S / RESEND_EVERY_S)):
            waited.wait(RESEND_EVERY_S)
            if not still_wanted() or signal.getsignal(signal.SIGINT) != self.handler:  # (no lock held: it may take others)
                return
            with self._lock:
                if self._seen != seen:
                    return
                _sigint_main()


def _sigint_main() -> None:
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
