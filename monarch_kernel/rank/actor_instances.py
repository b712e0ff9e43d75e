"""An actor instance's own life on a rank: made on the thread its endpoints will use, and ended with its
concurrent endpoints' tasks cancelled and its `__cleanup__` run.

As in Monarch, an actor whose endpoints are async is constructed on its own event loop (the thread its
endpoints run on, `rank/actor_loops.py`), so thread-local state its `__init__` sets is theirs; a sync actor is made on the thread
that spawns it. Ending a stopped or failed actor (`end_instance`) cancels the tasks of its concurrent
endpoints and waits for them, then runs its `__cleanup__(error)`: an async one on the actor's loop, a sync
one on the calling thread, in the actor's context. A clean-up that raises or never ends is reported on the
rank's stderr and the stop goes on. `rank/actor_host.py` decides when an actor is made or ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import sys
import threading
import traceback
import types
from typing import Any

from monarch_kernel.rank.mailbox import Mailbox, context_at, serves_async

CLEANUP_S = 10.0  # how long ending an actor waits for its cancelled tasks and its async __cleanup__


def construct(cls: type, args: tuple, kwargs: dict, loop: asyncio.AbstractEventLoop | None,
              loop_thread: int) -> Any:
    """cls(*args, **kwargs), in the calling context. An actor that serves async endpoints is made on `loop`
    (run by thread `loop_thread`) unless this is that thread; the others right here."""
    if not serves_async(cls) or loop is None or loop.is_closed() or threading.get_ident() == loop_thread:
        return cls(*args, **kwargs)
    made: concurrent.futures.Future[Any] = concurrent.futures.Future()
    context = contextvars.copy_context()  # (the actor's point and key, set by the spawn)

    def on_loop() -> None:
        if not made.set_running_or_notify_cancel():
            return
        try:
            made.set_result(context.run(cls, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - raised again in the spawning thread
            made.set_exception(exc)

    loop.call_soon_threadsafe(on_loop)
    return made.result()  # (a stop of the spawn interrupts this wait; the constructor then ends on the loop)


def constructor_traceback(tb: types.TracebackType | None, *spawn_files: str) -> types.TracebackType | None:
    """A failed constructor's traceback from the constructor down: without the spawn's own frames (this
    module's and those of `spawn_files`) and the wait for a constructor that ran on the event loop."""
    skipped = {__file__, concurrent.futures._base.__file__, *spawn_files}
    while tb is not None and tb.tb_frame.f_code.co_filename in skipped:
        tb = tb.tb_next
    return tb


def end_instance(box: Mailbox, error: BaseException | None, *, rank: int, lock: threading.Lock,
                 loop: asyncio.AbstractEventLoop | None, loop_thread: int) -> None:
    """Cancel the tasks of a stopped actor's concurrent endpoints (waiting for them, up to CLEANUP_S), then
    run its `__cleanup__(error)` (an async one on `loop`), in the actor's context; `error`: what made the
    actor fail (None: it was stopped). `lock` guards `box.tasks`."""
    with lock:
        tasks = list(box.tasks)
    on_loop = threading.get_ident() == loop_thread
    if tasks and loop is not None and not loop.is_closed():
        async def cancel_all() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=CLEANUP_S)

        if on_loop:
            for task in tasks:
                task.cancel()
        else:
            _wait_on_loop(loop, cancel_all(), rank, "cancelling its concurrent endpoints")
    cleanup = getattr(type(box.instance), "__cleanup__", None)
    if cleanup is None:
        return
    ctx = context_at(box.point, box.key)
    if inspect.iscoroutinefunction(cleanup):
        if loop is None or loop.is_closed() or on_loop:
            print(f"{box.name}: the async __cleanup__ could not run (its event loop is "
                  f"{'this thread' if on_loop else 'gone'})", file=sys.stderr)
            return
        _wait_on_loop(loop, _async_cleanup(box, ctx, error, rank), rank, "its __cleanup__")
        return
    try:
        ctx.run(cleanup, box.instance, error)
    except Exception:  # noqa: BLE001 - a failing clean-up is reported, the stop goes on
        print(f"{box.name} on rank {rank}: __cleanup__ raised:", file=sys.stderr)
        traceback.print_exc()


async def _async_cleanup(box: Mailbox, ctx: contextvars.Context, error: BaseException | None, rank: int) -> None:
    try:
        await asyncio.get_running_loop().create_task(box.instance.__cleanup__(error), context=ctx)
    except Exception:  # noqa: BLE001 - reported, the stop goes on
        print(f"{box.name} on rank {rank}: __cleanup__ raised:", file=sys.stderr)
        traceback.print_exc()


def _wait_on_loop(loop: asyncio.AbstractEventLoop, coro: Any, rank: int, what: str) -> None:
    done = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        done.result(timeout=CLEANUP_S)
    except concurrent.futures.TimeoutError:
        print(f"rank {rank}: stopping an actor: {what} took over {CLEANUP_S:.0f} s; stopped waiting",
              file=sys.stderr)
