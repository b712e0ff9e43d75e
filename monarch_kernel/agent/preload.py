"""Modules the agent imports before it forks ranks, so every rank starts with them loaded.

The controller names them (`Preload`, its first message; torch by default when the mesh has
a process group). They load on a thread while the agent talks to the controller, so the
import overlaps the rest of the start-up; forking waits for it, and for the thread to end
(a fork must not copy a process in the middle of an import).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import threading
import time
import traceback


class Preloader:
    """Imports a list of modules once, on a thread; `ready()` waits for them."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._done: asyncio.Event | None = None
        self.failure: str | None = None  # what could not be imported, for the start's error
        self.seconds = 0.0

    def start(self, modules: tuple[str, ...]) -> None:
        """Begin importing `modules` (a second call while the first runs is ignored)."""
        if self._thread is not None or not modules:
            return
        loop = asyncio.get_running_loop()
        done = self._done = asyncio.Event()

        def load() -> None:
            began = time.monotonic()
            try:
                for name in modules:
                    importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - reported when ranks start
                self.failure = (f"cannot preload {name!r}: {type(exc).__name__}: {exc}\n"
                                f"{traceback.format_exc(limit=-3)}"
                                "install it on this host, or leave it out of preload")
            # what the imports made lives as long as the process: out of the collector's sight, a
            # full collection on a rank takes a millisecond instead of ~150 ms, and forked ranks
            # share those pages instead of copying them when the collector touches them
            gc.collect()
            gc.freeze()
            self.seconds = time.monotonic() - began
            loop.call_soon_threadsafe(done.set)

        self._thread = threading.Thread(target=load, name="monarch-preload", daemon=True)
        self._thread.start()

    async def ready(self) -> None:
        """Until the imports are done and their thread has ended (raises RuntimeError if one failed)."""
        if self._done is None or self._thread is None:
            return
        await self._done.wait()
        self._thread.join()
        if self.failure is not None:
            raise RuntimeError(self.failure)
