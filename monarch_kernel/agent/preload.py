"""Modules the agent imports before it forks ranks, so every rank starts with them loaded.

The controller names them (`Preload`, its first message; torch by default when the mesh has
a process group). They load on a thread while the agent talks to the controller, so the
import overlaps the rest of the start-up; forking waits for it, and for the thread to be gone
from the kernel: a fork must not copy a process in the middle of an import, nor in the middle of
a thread's exit. Python's `join` returns before the thread has run its C libraries' thread-exit
destructors, and MKL (inside torch) frees the buffers that `import torch` made on that thread
there, under a spin lock; a rank forked in that window inherits the lock held and its first
matmul spins on it forever.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import threading
import time
import traceback

THREAD_EXIT_S = 10.0  # how long a thread that returned may take to leave the kernel's task list


async def until_thread_gone(native_id: int, timeout: float = THREAD_EXIT_S) -> None:
    """Until thread `native_id` of this process has fully exited (its thread-exit destructors ran).

    Raises RuntimeError when it is still there after `timeout` seconds."""
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + timeout
    pause = 0.0002
    while os.path.exists(task):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent's import thread (tid {native_id}) did not exit within {timeout:.0f} s "
                               "of finishing its imports; forking ranks now could copy a lock it holds. "
                               "Look for a library whose thread-exit handler hangs, or leave it out of preload")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.01)


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
        """Until the imports are done and their thread has left the process (raises RuntimeError if an
        import failed)."""
        if self._done is None or self._thread is None:
            return
        await self._done.wait()
        self._thread.join()
        if self._thread.native_id is not None:
            await until_thread_gone(self._thread.native_id)
        if self.failure is not None:
            raise RuntimeError(self.failure)
