"""Future: the one shape of "work in flight on ranks" (cells, pushes, actor calls).

`.get(timeout)` blocks and can be interrupted; `await` works too. A timeout or an
interrupt tells the remote work to stop, waits INTERRUPT_GRACE_S for the ranks to
confirm, and raises MeshTimeoutError or MeshInterrupted with what each rank said.
The outcome is kept: a second `get()` returns (or raises) the same thing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, Generic, TypeVar

from monarch_kernel.core.errors import MeshInterrupted, MeshTimeoutError
from monarch_kernel.core.supervision import program_ending

T = TypeVar("T")
INTERRUPT_GRACE_S = 0.8  # how long a stopped run waits for the ranks' tracebacks
# how much longer it waits for ranks known to be unwinding (a stop ended the collective they waited in: they will
# answer, and on a loaded machine that can take seconds; a second Ctrl-C stops waiting)
UNWIND_GRACE_S = 10.0


class Future(ABC, Generic[T]):
    """Work in flight: `.get(timeout)` (interruptible), `.result()`, `await`, `.done()`."""

    def __init__(self, timeout: float | None = None) -> None:
        self._default_timeout = timeout
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None

    # ------------------------------------------------------------ what each kind provides
    @abstractmethod
    def done(self) -> bool:
        """Whether every rank has answered (or failed)."""

    @abstractmethod
    def _wait(self, timeout: float | None) -> bool:
        """Block until done (True) or the timeout passes (False); Ctrl-C raises KeyboardInterrupt.

        Called even when the work is already done (to deliver what is still queued).
        """

    @abstractmethod
    async def _wait_async(self) -> None:
        """Wait on the running asyncio loop until done."""

    @abstractmethod
    def _cancel(self) -> None:
        """Tell the ranks still working to stop."""

    @abstractmethod
    def _finish(self) -> T:
        """The result of a finished run (raises the ranks' errors)."""

    @abstractmethod
    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        """The error of a run stopped by a timeout or interrupt, after the grace period."""

    # ------------------------------------------------------------ shared behaviour
    def get(self, timeout: float | None = None) -> T:
        """Wait for the result; raises the ranks' error, MeshInterrupted or MeshTimeoutError."""
        with self._lock:
            if self._outcome is None:
                self._outcome = self._settle(self._default_timeout if timeout is None else timeout)
        ok, value = self._outcome
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def result(self, timeout: float | None = None) -> T:
        """Alias of get()."""
        return self.get(timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self._await().__await__()

    @staticmethod
    def _from_coro(coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """A future of a coroutine's value (Monarch's `Future._from_coro`): `await` runs it on the caller's loop,
        `get()` on a loop of its own."""
        return CoroutineFuture(coroutine)

    def as_asyncio(self) -> asyncio.Future[T]:
        """An `asyncio.Future` of the running loop that resolves as this one does (Monarch's `as_asyncio()`);
        each call gives a fresh one. RuntimeError off a running loop."""
        return asyncio.get_running_loop().create_task(self._await())

    async def _await(self) -> T:
        if not self.done():
            try:
                await self._wait_async()
            except BaseException:  # cancelled: stop the remote work too
                self._cancel()
                raise
        return self.get()

    def _settle(self, timeout: float | None) -> tuple[bool, Any]:
        try:
            finished = self._wait(timeout)
        except KeyboardInterrupt:
            if (ending := program_ending()) is not None:  # an unhandled failure ends the program, not a stop
                raise ending from None
            return False, self._stop("was interrupted", MeshInterrupted)
        if not finished:
            return False, self._stop(f"timed out after {timeout:g} s", MeshTimeoutError)
        try:
            return True, self._finish()
        except BaseException as exc:  # noqa: BLE001 - kept, and raised by get()
            return False, exc

    def _stop(self, why: str, error_type: type[BaseException]) -> BaseException:
        self._cancel()
        try:
            finished = self._wait(INTERRUPT_GRACE_S)
            deadline = time.monotonic() + UNWIND_GRACE_S
            while not finished and self._unwinding() and (left := deadline - time.monotonic()) > 0:
                finished = self._wait(min(left, INTERRUPT_GRACE_S))
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: stop waiting for tracebacks
        return self._stopped(why, error_type)

    def _unwinding(self) -> bool:
        """Whether ranks that have not answered the stop yet are known to be ending their work (then the stop
        waits for them up to UNWIND_GRACE_S more). None are by default."""
        return False


class DoneFuture(Future[T]):
    """A future that is already done: what an operation that finished at once returns."""

    def __init__(self, value: T):
        super().__init__()
        self._value = value

    def done(self) -> bool:
        """Always True."""
        return True

    def _wait(self, timeout: float | None) -> bool:
        return True

    async def _wait_async(self) -> None:
        return None

    def _cancel(self) -> None:
        return None

    def _finish(self) -> T:
        return self._value

    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        return error_type(why)


class FailedFuture(DoneFuture[T]):
    """A future that is already done with an error: `get()` and `await` raise it."""

    def __init__(self, error: BaseException):
        super().__init__(None)  # type: ignore[arg-type]
        self._error = error

    def _finish(self) -> T:
        raise self._error


class CoroutineFuture(Future[T]):
    """A coroutine's value, run once, when first asked for: awaited on the caller's loop, or, by `get()`, to the end
    on a loop of its own in this thread (so not from inside a running loop: await it there)."""

    def __init__(self, coroutine: Coroutine[Any, Any, T]):
        super().__init__()
        self._coroutine: Coroutine[Any, Any, T] | None = coroutine
        self._ran: tuple[bool, Any] | None = None

    def done(self) -> bool:
        """Whether the coroutine has run to its end."""
        return self._ran is not None

    def _take(self) -> Coroutine[Any, Any, T]:
        coroutine, self._coroutine = self._coroutine, None
        if coroutine is None:
            raise RuntimeError("this future's coroutine is already running, or was stopped")
        return coroutine

    async def _run(self, coroutine: Coroutine[Any, Any, T]) -> None:
        try:
            self._ran = (True, await coroutine)
        except Exception as exc:  # noqa: BLE001 - kept, and raised by get()
            self._ran = (False, exc)

    def _wait(self, timeout: float | None) -> bool:
        if self._ran is not None:
            return True
        if self._coroutine is None:  # (stopped, or running elsewhere: it will not end here)
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("get() of a coroutine's future inside a running event loop would block it: await it")
        coroutine = self._take()
        try:
            asyncio.run(asyncio.wait_for(self._run(coroutine), timeout))
        except TimeoutError:
            return False
        return True

    async def _wait_async(self) -> None:
        if self._ran is None:
            await self._run(self._take())

    def _cancel(self) -> None:
        if self._coroutine is not None:
            self._coroutine.close()
            self._coroutine = None

    def _finish(self) -> T:
        assert self._ran is not None
        ok, value = self._ran
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        return error_type(f"the coroutine {why}")


class FoldedFuture(Future[T]):
    """`combine(...combine(identity, v1)..., vN)` of the values of `futures`, in their order (Monarch's
    `Accumulator.accumulate`): waiting waits for each in turn; a timeout or interrupt stops them all."""

    def __init__(self, futures: Sequence[Future[Any]], identity: T, combine: Callable[[T, Any], T]):
        super().__init__()
        self._futures = list(futures)
        self._identity = identity
        self._combine = combine

    def done(self) -> bool:
        """Whether every value is in."""
        return all(future.done() for future in self._futures)

    def _wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in self._futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not future._wait(left):
                return False
        return True

    async def _wait_async(self) -> None:
        for future in self._futures:
            if not future.done():
                await future._wait_async()

    def _cancel(self) -> None:
        for future in self._futures:
            if not future.done():
                future._cancel()

    def _finish(self) -> T:
        value = self._identity
        for future in self._futures:
            value = self._combine(value, future.get())
        return value

    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        waiting = next((future for future in self._futures if not future.done()), None)
        return error_type(f"accumulating {why}") if waiting is None else waiting._stopped(why, error_type)
