"""The event loop a rank serves its async actors on, for code that runs on the rank and has a coroutine to
finish there (an async `spawn_procs(bootstrap=...)`): it runs where the rank's actors would await it, so
actor calls inside it are served as from an async endpoint. The rank's actor host sets it when its loop
starts; in a process that is not a rank the coroutine gets a loop of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

_loop: asyncio.AbstractEventLoop | None = None
_loop_thread = 0


def set_rank_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The rank's actor event loop (called on the thread that runs it)."""
    global _loop, _loop_thread
    _loop, _loop_thread = loop, threading.get_ident()


def run_on_rank_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` to its end on the rank's actor loop and return its result (a stop of the waiting thread
    cancels it). On the loop's own thread that would wait on itself: RuntimeError, await it instead."""
    loop = _loop
    if loop is None or loop.is_closed():
        return asyncio.run(coro)
    if threading.get_ident() == _loop_thread:
        coro.close()
        raise RuntimeError("this runs on the rank's event loop already: await the coroutine instead")
    done = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return done.result()
    except BaseException:
        done.cancel()
        raise
