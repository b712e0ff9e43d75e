"""Stopping an actor's sync call wherever it runs: SIGINT on the rank's main thread, an
asynchronous KeyboardInterrupt on an actor's own thread (`rank/thread_stops.py`), and the end of a
collective the call waits in, which neither reaches."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.rank.interrupts import MainThreadInterrupts
from monarch_kernel.rank.recent import RecentKeys
from monarch_kernel.rank.thread_stops import stop_thread, withdraw_stop
from monarch_kernel.wire.calls import CallKey


class SyncCallStops:
    """Which thread runs each sync call, and the calls told to stop (a stop may come before its call)."""

    def __init__(self, interrupts: MainThreadInterrupts, wake: Callable[[], None]) -> None:
        self._interrupts = interrupts
        self._wake = wake  # wakes the threads waiting on actor calls (a stopped one leaves its wait)
        self._lock = threading.Lock()
        self._cancelled = RecentKeys()  # (the oldest, of calls long ended, are forgotten)
        self._running: dict[CallKey, int] = {}  # sync calls running -> the thread that runs each
        self._aborted: dict[CallKey, str] = {}  # stopped calls whose collectives were ended, and how
        self._main = threading.main_thread().ident or 0
        self.free_collectives: Callable[[int], str] | None = None  # ends a collective a thread waits in: how
        self.broken_by_peer: Callable[[BaseException], str] | None = None  # a collective's error: how it broke

    def cancel(self, key: CallKey) -> None:
        """Stop call `key`: now if it runs sync code, else as it starts."""
        with self._lock:
            self._cancelled.add(key)
            thread = self._running.get(key)
            if thread is not None:
                self._stop(key, thread)

    def stop_running(self) -> None:
        """Stop every sync call running now, on the actors' own threads and on the main thread (the
        notebook's interrupt)."""
        with self._lock:
            for key, thread in list(self._running.items()):
                self._cancelled.add(key)
                self._stop(key, thread)

    def _stop(self, key: CallKey, thread: int) -> None:
        if thread == self._main:
            # (an endpoint served inside this call's wait is stopped too: this call waits on it, or cannot go on
            # until it ends; telling the two apart needs the calls' ancestry, which ranks do not keep)
            self._interrupts.interrupt(lambda: key in self._running)
        else:
            stop_thread(thread)
            self._wake()
        ended = self.free_collectives(thread) if self.free_collectives is not None else ""
        if ended:  # (a signal cannot reach into a collective's wait: it was ended; its reply says so)
            self._aborted[key] = ended

    def failed(self, key: CallKey, exc: BaseException) -> None:
        """Call `key` raised `exc`: if inside a collective (another rank's stop ended it before this rank's
        stop came), its reply says the collective was ended, as a rank whose stop came first says."""
        how = self.broken_by_peer(exc) if self.broken_by_peer is not None else ""
        if how:
            with self._lock:
                self._aborted.setdefault(key, how)

    def cancelled(self, key: CallKey) -> bool:
        """Whether call `key` was told to stop."""
        with self._lock:
            return key in self._cancelled

    def starts(self, key: CallKey) -> bool:
        """Whether call `key` may start (False: it was told to stop). No stop is sent to the calling
        thread for it until `enter`: a stop before then is noted, and `enter` raises it."""
        return not self.cancelled(key)

    def enter(self, key: CallKey) -> None:
        """The calling thread enters call `key`'s user code (first thing inside the caller's `try`):
        stops reach it from now on; raises KeyboardInterrupt if it was told to stop already."""
        with self._lock:
            if key in self._cancelled:
                raise KeyboardInterrupt
            self._running[key] = threading.get_ident()

    def ended(self, key: CallKey) -> None:
        """Call `key`'s sync code ended: no stop is sent to its thread from now on."""
        with self._lock:
            self._running.pop(key, None)

    def run_stoppable(self, key: CallKey, run: Callable[[], Any]) -> Any:
        """run() on an actor's own thread: a stop raises in it until it ends, never after."""
        try:
            return run()
        finally:
            while True:
                try:
                    self.ended(key)
                    withdraw_stop(threading.get_ident())
                    break
                except KeyboardInterrupt:  # it came as run() ended: it was for run(), which ended
                    continue

    def answered(self, key: CallKey) -> str:
        """Call `key` is answered: forget it; how its collectives were ended ("" if they were not)."""
        with self._lock:
            self._cancelled.discard(key)
            return self._aborted.pop(key, "")
