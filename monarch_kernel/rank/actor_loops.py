"""An async actor's own event loop, on a thread of its own.

As in Monarch, each actor whose endpoints are async gets an event loop of its own: its constructor,
its endpoints, an async `__supervise__` and `__cleanup__` run there, so thread-local state its
`__init__` sets is theirs, and an actor that blocks its loop (a `time.sleep` in an `async def`, a
constructor that never returns) holds only itself. The rank's own loop (`rank-loop`) delivers calls
and serves the lanes and links; no user code runs on it.

The thread is named `actor-loop-<spawn key>` (`core.hangs.ENDPOINT_THREAD_PREFIX`: a hang report
shows it when it runs user code). `close()` ends it once the actor has ended.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Callable

from monarch_kernel.core.hangs import ENDPOINT_THREAD_PREFIX

LOOP_THREAD_PREFIX = f"{ENDPOINT_THREAD_PREFIX}loop-"
START_S = 30.0  # how long making an actor waits for its loop's thread to run (a very busy machine)
LEFTOVER_TASKS_S = 2.0  # how long a closing loop lets the tasks still on it end after they are cancelled


class ActorLoop:
    """One actor's event loop and the thread that runs it (started at once)."""

    def __init__(self, key: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.at_end: list[Callable[[], None]] = []  # run on the loop as it ends, after its tasks (its lanes' close)
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=f"{LOOP_THREAD_PREFIX}{key}",
                                        daemon=True)
        self._thread.start()
        if not started.wait(START_S):
            self.close()
            raise RuntimeError(f"the event loop of actor {key!r} did not start within {START_S:g} s")
        self.ident = self._thread.ident or 0

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            left = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.wait(left, timeout=LEFTOVER_TASKS_S))
            for end in self.at_end:
                try:
                    end()
                except Exception:  # noqa: BLE001 - one that fails must not keep the loop open (it is shown)
                    traceback.print_exc()
            self.loop.close()

    def close(self) -> None:
        """End the loop (what still runs on it is cancelled) and its thread; from any thread."""
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # (closed meanwhile)
                pass
