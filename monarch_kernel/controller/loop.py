"""The controller's thread: one asyncio loop in the kernel process that every mesh shares.

Everything that touches a mesh's state runs on this loop; the notebook's thread hands
work over with `call` (fire and forget) or `run` (a coroutine, with a concurrent future).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class ControllerLoop:
    """The process-wide background event loop that all meshes share."""

    _instance: ControllerLoop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="monarch-controller", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> ControllerLoop:
        """The shared loop, started on first use."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = ControllerLoop()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the loop; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread soon."""
        self.loop.call_soon_threadsafe(fn, *args)

    @classmethod
    def stop(cls, timeout: float = 5.0) -> None:
        """End the shared loop and its thread, if it runs (again and again: nothing happens). The next
        get() starts a fresh one. Meshes still open on it stop being served: shut them down first."""
        with cls._lock:
            instance, cls._instance = cls._instance, None
        if instance is None:
            return
        instance.loop.call_soon_threadsafe(instance.loop.stop)
        instance.thread.join(timeout)
        if not instance.thread.is_alive():
            instance.loop.close()
