"""The one Future behaviour every kind shares: wait, time out, interrupt, keep the outcome, await."""

import asyncio
import threading
import time

import pytest

from monarch_kernel.core.errors import MeshInterrupted, MeshTimeoutError
from monarch_kernel.core.future import INTERRUPT_GRACE_S, UNWIND_GRACE_S, Future

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


class Work(Future[str]):
    """Work that finishes when `finish()` is called, from any thread."""

    def __init__(self, timeout=None, stops_when_cancelled=True):
        super().__init__(timeout)
        self.event = threading.Event()
        self.cancelled = 0
        self.stops_when_cancelled = stops_when_cancelled
        self.results = 0

    def finish(self):
        self.event.set()

    def done(self):
        return self.event.is_set()

    def _wait(self, timeout):
        return self.event.wait(timeout)

    async def _wait_async(self):
        while not self.event.is_set():
            await asyncio.sleep(0.001)

    def _cancel(self):
        self.cancelled += 1
        if self.stops_when_cancelled:
            self.finish()

    def _finish(self):
        self.results += 1
        return "result"

    def _stopped(self, why, error_type):
        return error_type(f"work {why}", [])


def test_get_waits_and_keeps_the_outcome():
    work = Work()
    threading.Timer(0.01, work.finish).start()
    assert work.get(timeout=10) == "result" and work.result() == "result"
    assert work.results == 1  # computed once


def test_a_timeout_stops_the_work_and_raises_exactly_mesh_timeout_error():
    work = Work()
    with pytest.raises(MeshTimeoutError) as caught:
        work.get(timeout=0.01)
    assert type(caught.value) is MeshTimeoutError and "timed out after 0.01 s" in str(caught.value)
    assert work.cancelled == 1
    with pytest.raises(MeshTimeoutError):
        work.get()  # the same outcome again, without waiting again
    assert work.cancelled == 1


def test_the_default_timeout_applies():
    with pytest.raises(MeshTimeoutError):
        Work(timeout=0.01).get()


def test_an_interrupt_stops_the_work_and_raises_mesh_interrupted():
    class Interrupted(Work):
        def _wait(self, timeout):
            if not self.cancelled:
                raise KeyboardInterrupt
            return super()._wait(timeout)

    work = Interrupted()
    with pytest.raises(MeshInterrupted) as caught:
        work.get()
    assert type(caught.value) is MeshInterrupted and work.cancelled == 1


def test_work_that_ignores_the_stop_is_given_up_after_the_grace_period():
    work = Work(stops_when_cancelled=False)
    with pytest.raises(MeshTimeoutError):
        work.get(timeout=0.01)
    assert work.cancelled == 1 and INTERRUPT_GRACE_S < 2


class Unwinding(Work):
    """Work whose stop ends a collective: it is known to be ending (`_unwinding`) and ends `after` s later
    (a loaded machine unwinding it); `_stopped` says whether it ended by then."""

    def __init__(self, after):
        super().__init__(stops_when_cancelled=False)
        self.after = after

    def _cancel(self):
        self.cancelled += 1
        threading.Timer(self.after, self.finish).start()

    def _unwinding(self):
        return not self.done()

    def _stopped(self, why, error_type):
        return error_type(f"work {why}; {'ended' if self.done() else 'still running'}", [])


def test_a_stop_waits_beyond_the_grace_for_work_known_to_be_ending():
    """The straggler of issue 41's loaded runs: the stop ended the collective, the rank took more than the grace
    period to answer, and was reported still running (and the group was not made anew)."""
    work = Unwinding(after=INTERRUPT_GRACE_S * 2.5)
    with pytest.raises(MeshTimeoutError) as caught:
        work.get(timeout=0.01)
    assert "work timed out after 0.01 s; ended" in str(caught.value), caught.value


def test_work_known_to_be_ending_is_still_given_up_after_the_longer_grace(monkeypatch):
    monkeypatch.setattr("monarch_kernel.core.future.UNWIND_GRACE_S", 1.0)  # (10 s in use)
    work = Unwinding(after=60)
    started = time.monotonic()
    with pytest.raises(MeshTimeoutError) as caught:
        work.get(timeout=0.01)
    assert "still running" in str(caught.value)
    assert INTERRUPT_GRACE_S + 1.0 <= time.monotonic() - started < UNWIND_GRACE_S


def test_await_returns_the_result_and_a_cancelled_await_stops_the_work():
    async def main():
        done = Work()
        asyncio.get_running_loop().call_later(0.01, done.finish)
        value = await done
        pending = Work(stops_when_cancelled=False)
        task = asyncio.ensure_future(pending._await())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return value, pending.cancelled

    assert asyncio.run(main()) == ("result", 1)


async def _value_after(value, seconds=0.0):
    await asyncio.sleep(seconds)
    return value


async def _raises():
    raise ValueError("from the coroutine")


def test_a_coroutines_future_runs_it_once_by_get_or_by_await():
    future = Future._from_coro(_value_after("x"))
    assert not future.done()
    assert future.get() == "x" and future.get() == "x" and future.done()
    assert asyncio.run(_await(Future._from_coro(_value_after("y")))) == "y"
    failing = Future._from_coro(_raises())
    with pytest.raises(ValueError, match="from the coroutine"):
        failing.get()
    with pytest.raises(ValueError):  # (kept)
        failing.get()


async def _await(future):
    return await future


def test_a_coroutines_future_times_out_and_refuses_to_block_a_running_loop():
    with pytest.raises(MeshTimeoutError):
        Future._from_coro(_value_after("late", 5.0)).get(timeout=0.05)

    async def blocking_get():
        future = Future._from_coro(_value_after("z"))
        with pytest.raises(RuntimeError, match="await it"):
            future.get()
        assert await future == "z"  # (still whole)

    asyncio.run(blocking_get())


def test_a_folded_future_combines_its_futures_in_order_from_the_identity():
    from monarch_kernel.core.future import FoldedFuture

    parts = [Future._from_coro(_value_after(v)) for v in ("a", "b", "c")]
    assert FoldedFuture(parts, "", lambda acc, v: acc + v).get() == "abc"
    assert FoldedFuture([], 7, lambda acc, v: acc + v).get() == 7
    awaited = [Future._from_coro(_value_after(v)) for v in (1, 2, 3)]
    assert asyncio.run(_await(FoldedFuture(awaited, [], lambda acc, v: acc + [v]))) == [1, 2, 3]


def test_a_folded_future_stops_every_part_still_running_when_it_times_out():
    from monarch_kernel.core.future import FoldedFuture

    done, hanging = Work(), Work(stops_when_cancelled=False)
    done.finish()
    with pytest.raises(MeshTimeoutError):
        FoldedFuture([done, hanging], 0, lambda acc, v: acc + 1).get(timeout=0.05)
    assert hanging.cancelled == 1 and done.cancelled == 0


def test_an_accumulator_folds_whatever_its_endpoint_streams_with_the_arguments_given():
    from monarch_kernel.actors.helpers import Accumulator

    class Streaming:
        def __init__(self):
            self.asked = []

        def stream(self, *args, **kwargs):
            self.asked.append((args, kwargs))
            return iter([Future._from_coro(_value_after(v)) for v in (3, 1, 2)])

    endpoint = Streaming()
    assert Accumulator(endpoint, [], lambda acc, v: acc + [v]).accumulate("a", k=1).get() == [3, 1, 2]
    assert endpoint.asked == [(("a",), {"k": 1})]
