"""Waiting on the controller loop's work from the notebook's thread, with a live progress line.

A line (files and bytes, per host) appears once the work has taken longer than
PROGRESS_AFTER_S and is rewritten in place (`\\r`) until it ends; the stop button cancels
the work and raises MeshInterrupted.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from monarch_kernel.core.errors import MeshInterrupted

T = TypeVar("T")
PROGRESS_AFTER_S = 0.5


def size_text(n: float) -> str:
    """Bytes as people read them: 1.2 GB, 340.0 kB, 12 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def show_stdout(text: str) -> None:
    """Write to the notebook's output now."""
    sys.stdout.write(text)
    sys.stdout.flush()


def wait_showing(future: concurrent.futures.Future[T], line: Callable[[], str], what: str,
                 show: Callable[[str], None] = show_stdout) -> T:
    """The future's result; a live line meanwhile; Ctrl-C (the stop button) cancels the work."""
    started = time.monotonic()
    shown = False
    try:
        while True:
            try:
                return future.result(timeout=0.2)
            except TimeoutError:
                if time.monotonic() - started > PROGRESS_AFTER_S:
                    show("\r" + line())
                    shown = True
    except KeyboardInterrupt:
        future.cancel()
        raise MeshInterrupted(f"{what} was stopped; what was already moved stays, and running it again goes on "
                              "from there", []) from None
    finally:
        if shown:
            show("\r" + line() + "\n")


def progress_line(label: str, progress: dict[str, Any]) -> str:
    """`label: host-0 3/10 files, 1.2 GB/4.0 GB; host-1 ...` from Progress records by host."""
    parts = [f"{host} {p.files_done}/{p.files_total} files, {size_text(p.bytes_done)}/{size_text(p.bytes_total)}"
             for host, p in progress.items()]
    return f"{label}: " + "; ".join(parts)
