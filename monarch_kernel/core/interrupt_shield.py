"""Sections that a stop cannot split: a system call and the bookkeeping of what it did.

A KeyboardInterrupt is raised between two lines of Python, so one that lands after
`sock.sendmsg()` returned and before the caller recorded how much was sent leaves the sent
bytes queued: they go out again with the next write (a cell ran twice on one rank). One that
lands in the middle of a fan-out sends a cell to some ranks and not to others. On the read side,
bytes taken from a socket before the reader counted them are lost, and the stream falls out of
step with its frames. `shielded(fn)` runs such a section whole and raises the stop right after:

- on the main thread, where a stop is SIGINT (the notebook's stop button, a rank's interrupt),
  the section runs under `StopsNoted`: a SIGINT handler that only notes the signal. The handler
  that was installed is put back afterwards and the signal raised again, so it runs as it would
  have. A handler that notes a stop itself while a section runs (`notes_in_sections`, the rank's
  own: a rank's main thread sends a reply per request and call) is left in place, and called as
  the section ends: no handler change, no system call. A wait that reads the sockets in a loop
  holds one `StopsNoted` for the whole loop and raises a noted stop at a point of its choosing
  (`raise_if_noted`), between two reads; the sections inside it then cost nothing more (changing
  a handler is a system call each time);
- on other threads, where a stop is an asynchronous exception sent by `defer_or_stop`
  (`rank/thread_stops.py`), a stop that comes during the section is held and raised as the
  section ends. One sent just before the section began is raised by Python as the section's
  first function starts (every Python function checks for it on entry), before any system call.

Threads: any. `_lock` guards `_depth` and `_held` (the threads inside a section, and the stops
held for them); it is never held while a section runs. `_noting` is the main thread's own.
"""

from __future__ import annotations

import os
import signal
import threading
from _thread import get_ident
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

try:  # the C functions under `signal`'s own: theirs turn handlers into enums, at twenty times the cost
    from _signal import getsignal as _handler_now  # type: ignore[import-not-found, unused-ignore]
    from _signal import signal as _set_handler  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - another Python than CPython
    _set_handler, _handler_now = signal.signal, signal.getsignal

_lock = threading.Lock()
_depth: dict[int, int] = {}  # thread -> how many sections it is inside (sections may nest)
_held: set[int] = set()  # threads a stop came for during a section: raised as it ends
_main_ident = threading.main_thread().ident  # (a forked child's is the thread that forked: see below)
_noting: dict[int, Any] | None = None  # while the main thread notes its stops: where (signal -> frame)
_noting_itself: Any = None  # a SIGINT handler that notes a stop itself during a section (`notes_in_sections`)


def _after_fork() -> None:
    global _main_ident, _noting
    _main_ident, _noting = get_ident(), None


os.register_at_fork(after_in_child=_after_fork)


class StopsNoted:
    """On the main thread, while entered: SIGINT is noted, not raised. On leaving, the handler that was
    installed is back and a noted SIGINT is raised again for it. Elsewhere, or inside another, it does nothing."""

    def __init__(self) -> None:
        self._noted: dict[int, Any] = {}
        self._installed: Any = None
        self._active = False

    def __enter__(self) -> StopsNoted:
        global _noting
        if _noting is None and get_ident() == _main_ident:
            # the C signal() runs a pending handler before it installs the new one, so a stop either comes
            # before (nothing is changed yet) or is noted; the handler is C code (dict.__setitem__): a stop
            # that comes is noted without running a line of Python
            self._installed = _set_handler(signal.SIGINT, self._noted.__setitem__)
            self._active, _noting = True, self._noted
        return self

    def raise_if_noted(self) -> None:
        """Raise KeyboardInterrupt if a stop came (a point where the caller may be stopped)."""
        if self._active and self._noted:
            self._noted.clear()
            raise KeyboardInterrupt

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _noting
        if self._active:
            self._active, _noting = False, None
            _give_back(self._installed, self._noted)


def _give_back(installed: Any, noted: dict[int, Any]) -> None:
    """Put the handler back; raise a noted SIGINT again for it (it runs now, as if the stop came now)."""
    _set_handler(signal.SIGINT, installed if installed is not None else signal.SIG_DFL)
    if noted:
        signal.raise_signal(signal.SIGINT)


def notes_in_sections(handler: Callable[[int, Any], Any] | None) -> None:
    """Declare `handler` (installed for SIGINT on the main thread) to begin with `noted_in_section`: while it
    is the one installed, sections leave it there and call it as they end if a stop came."""
    global _noting_itself
    _noting_itself = handler


def noted_in_section(signum: int, frame: Any) -> bool:
    """For a handler declared with `notes_in_sections`: True when the main thread is inside a section (the
    stop is noted, and the handler is called again as the section ends); then it must return at once."""
    if _noting is None:
        return False
    _noting[signum] = frame
    return True


def main_thread_notes_stops() -> bool:
    """Whether the main thread is inside a section or a wait that notes SIGINT (its handler is swapped)."""
    return _noting is not None


def shielded(fn: Callable[[], T]) -> T:
    """fn(), which a stop does not interrupt: the stop is raised as fn returns (or raises)."""
    global _noting
    ident = get_ident()
    if ident == _main_ident:
        if _noting is not None:  # (inside a section, or a wait that notes its stops)
            return fn()
        noted: dict[int, Any] = {}
        itself = _noting_itself
        if itself is not None and _handler_now(signal.SIGINT) is itself:  # (it notes the stop: no change)
            _noting = noted
            try:
                return fn()
            finally:
                _noting = None
                if noted:
                    itself(signal.SIGINT, noted[signal.SIGINT])  # as if the stop came now
        installed = _set_handler(signal.SIGINT, noted.__setitem__)  # (see StopsNoted.__enter__)
        _noting = noted
        try:
            return fn()
        finally:
            _noting = None
            _give_back(installed, noted)
    try:
        _enter(ident)
        return fn()
    finally:
        if _leave(ident):
            raise KeyboardInterrupt


def defer_or_stop(ident: int, stop: Callable[[], Any]) -> bool:
    """stop() thread `ident` now (True), or hold the stop until its section ends (False)."""
    with _lock:
        if _depth.get(ident):
            _held.add(ident)
            return False
        stop()
        return True


def withdraw(ident: int) -> None:
    """Forget a stop held for thread `ident` (what it was for has ended)."""
    with _lock:
        _held.discard(ident)


def _enter(ident: int) -> None:
    with _lock:
        _depth[ident] = _depth.get(ident, 0) + 1


def _leave(ident: int) -> bool:
    """Leave a section; True when a stop was held for it and it was the outermost."""
    with _lock:
        depth = _depth.get(ident, 1) - 1
        if depth:
            _depth[ident] = depth
            return False
        _depth.pop(ident, None)
        if ident in _held:
            _held.discard(ident)
            return True
        return False

