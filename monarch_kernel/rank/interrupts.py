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

import itertools
import signal
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.interrupt_shield import main_thread_notes_stops
from monarch_kernel.rank.debugging import untraced

RESEND_EVERY_S = 0.05
GIVE_UP_AFTER_S = 5.0


class MainThreadInterrupts:
    """Sends SIGINT to the main thread until the handler claims it for the run it was meant for.

    A stop is addressed to a run, not to the thread: `interrupt(alive, current)` takes whether the run
    has not ended yet, and whether the main thread is in its user code now (a stop that comes while the
    rank's own code runs for it waits, and is sent again, until its user code runs). The handler raises
    only for a stop whose run is current (`claim`); a stop whose run ended is dropped, never deferred
    to whatever runs next. Threads: any thread may interrupt; the handler runs on the
    main thread; `_lock` guards `_wanted` and `_seen` and a send with the check before it.
    """

    def __init__(self, send: Callable[[], None] | None = None, follow_up: bool = True) -> None:
        self._send = send or _sigint_main  # (tests: a fake main thread's signal)
        self._follow = follow_up  # a thread sends it again until claimed (tests call `resend` instead)
        self._seen = 0  # stops claimed by the handler
        self._wanted: dict[int, tuple[Callable[[], bool], Callable[[], bool]]] = {}  # ticket -> (alive, current)
        self._tickets = itertools.count(1)
        self._lock = threading.RLock()  # (re-entered by the handler when the main thread itself interrupts)
        self.handler: Any = None  # the rank's SIGINT handler: another one (the user's) is sent to once

    def interrupt(self, alive: Callable[[], bool], current: Callable[[], bool] | None = None) -> None:
        """SIGINT the main thread now, and again until the handler claims it or the run ended (`alive()`
        false); `current()` (default: `alive`) says whether the run is what the main thread runs now."""
        with self._lock:
            ticket = next(self._tickets)
            self._wanted[ticket] = (alive, current or alive)
            self._send()
        if not self._follow:
            return
        untraced(threading.Thread(target=self._follow_up, args=(ticket, alive), name="interrupt-follow-up",
                                  daemon=True)).start()

    def claim(self) -> bool:
        """For the handler: whether a stop was sent for what the main thread runs now (then it is spent);
        False for a stop that came too late (its run ended) or too early (its run is not current)."""
        with self._lock:
            hits = [ticket for ticket, (alive, current) in self._wanted.items() if alive() and current()]
            for ticket in hits:
                del self._wanted[ticket]
            if hits:
                self._seen += 1
            return bool(hits)

    def resend(self) -> int:
        """One round of what the follow-ups do: SIGINT again if a stop is still wanted for a run not ended
        (those of ended runs are forgotten); how many are wanted."""
        with self._lock:
            for ticket, (alive, _) in list(self._wanted.items()):
                if not alive():
                    del self._wanted[ticket]
            if self._wanted:
                self._send()
            return len(self._wanted)

    def _follow_up(self, ticket: int, alive: Callable[[], bool]) -> None:
        waited = threading.Event()
        try:
            for _ in range(int(GIVE_UP_AFTER_S / RESEND_EVERY_S)):
                waited.wait(RESEND_EVERY_S)
                if not alive():
                    return
                handler = signal.getsignal(signal.SIGINT)
                if handler != self.handler and not main_thread_notes_stops():  # (the user's own: sent once)
                    return
                with self._lock:
                    if ticket not in self._wanted:
                        return  # claimed
                    self._send()
        finally:
            with self._lock:
                self._wanted.pop(ticket, None)


def _sigint_main() -> None:
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
