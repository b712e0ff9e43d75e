"""Stopping user code that runs on a thread other than the rank's main thread.

Only the main thread receives signals, so a stop reaches an endpoint on an actor's own thread
(`rank/user_threads.py`) as an asynchronous KeyboardInterrupt, which Python raises in that
thread at its next line. A thread asleep in C does not run a line until it wakes, so the rank's
`time.sleep` (installed at start, for every thread) sleeps on those threads on an event the stop
sets: `time.sleep(600)` in such an endpoint stops at once, as it does on the main thread. Other
blocking calls (a socket read, a lock) see the stop when they return; a collective is ended by
the stop itself (`rank/collectives.py`).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any, SupportsIndex

from monarch_kernel.core.interrupt_shield import defer_or_stop, withdraw

_real_sleep = time.sleep
_wakes: dict[int, threading.Event] = {}  # the threads our stops may reach -> what wakes their sleep
rank_device: Any = None  # the rank's CUDA device (set by rank/dist.py), made current on each such thread


def setup_thread() -> None:
    """Make the calling thread one that stops reach (an actor's own thread, as it starts)."""
    _wakes[threading.get_ident()] = threading.Event()
    torch = sys.modules.get("torch")
    if rank_device is not None and torch is not None:  # (the current device is per thread in CUDA)
        torch.cuda.set_device(rank_device)


def forget_thread() -> None:
    """The calling thread ends."""
    _wakes.pop(threading.get_ident(), None)


def stop_thread(ident: int) -> None:
    """Raise KeyboardInterrupt in thread `ident` at its next line, and wake it from `time.sleep`; a
    thread inside a write or read that a stop must not split raises it as that ends
    (`core/interrupt_shield.py`)."""
    def raise_there() -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))

    if defer_or_stop(ident, raise_there):
        wake = _wakes.get(ident)
        if wake is not None:
            wake.set()


def withdraw_stop(ident: int) -> None:
    """Forget a stop not yet raised in thread `ident` (what it was for has ended)."""
    withdraw(ident)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
    wake = _wakes.get(ident)
    if wake is not None:
        wake.clear()


def sleep(seconds: float | SupportsIndex) -> None:
    """`time.sleep`, which a stop wakes on the threads it reaches (see the module's note)."""
    wake = _wakes.get(threading.get_ident())
    if wake is None or not seconds:
        _real_sleep(seconds)
        return
    seconds = float(seconds)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        if wake.wait(remaining):
            wake.clear()  # a stop: its KeyboardInterrupt is raised at the next line


def install_sleep() -> None:
    """Make `time.sleep` the one above in this process (a rank, as it starts)."""
    time.sleep = sleep
