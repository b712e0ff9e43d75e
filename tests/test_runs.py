"""Stops address runs, not threads (`rank/runs.py`, issue 41), checked on every interleaving.

A fake rank: a main thread (a stop is SIGINT: pending until the thread runs its next line, then the
real `MainThreadInterrupts.claim` decides) and an actor's own thread (a stop is an asynchronous
exception, raised at its next line unless withdrawn). Runs of every kind execute as sequences of
lines ("points"), their user code inside the real `Runs.user_code`; a stop (by a run's key, or the
stop button's "whatever runs now") arrives at every point in turn, and after each the follow-ups
send again what is still wanted. For each schedule: the stop raises in its run's user code exactly
once (or in an endpoint that run's wait serves on its thread), or as its user code starts when it
came earlier; a stop that comes after a run's user code is dropped; nothing is ever raised in the
rank's own code or in a run the stop was not for; nothing stays pending at the end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from monarch_kernel.rank.interrupts import MainThreadInterrupts
from monarch_kernel.rank.runs import Run, RunKind, Runs

pytestmark = pytest.mark.unit

MAIN, OWN = 1, 2  # the fake threads


class FakeRank:
    """The threads' signals and asynchronous exceptions, by hand; a stepping clock of points."""

    def __init__(self, stop_at: int, stop: Callable[[Runs], None]) -> None:
        self.signal_pending = False
        self.async_pending: set[int] = set()
        self.interrupts = MainThreadInterrupts(send=self._signal_main, follow_up=False)
        self.main_thread = MAIN
        self.runs = Runs(self)
        self.clock = 0
        self.stop_at, self.stop = stop_at, stop
        self.raised_in: list[object] = []  # where each KeyboardInterrupt was raised: a run's key, or "own code"
        self.in_user_code_at_stop: set[object] = set()
        self.ended_user_code: dict[object, int] = {}  # run key -> the clock when its last user code ended
        self.stopped_at: int | None = None

    # StopDelivery
    def _signal_main(self) -> None:
        self.signal_pending = True

    def to_main_thread(self, alive, current) -> None:
        self.interrupts.interrupt(alive, current)

    def to_thread(self, thread: int) -> None:
        self.async_pending.add(thread)

    def withdraw(self, thread: int) -> None:
        self.async_pending.discard(thread)

    def end_collective(self, thread: int) -> str:
        return ""

    # the threads
    def point(self, thread: int, run: Run | None = None) -> None:
        """`thread` runs a line: of `run`'s user code, or of the rank's own code (None). A signal or an
        asynchronous exception sent before it is raised here; the stop of this moment comes during the line
        (from the reader thread), so it is raised at the thread's next line at the earliest."""
        self.interrupts.resend()  # (the follow-up threads)
        try:
            if thread == MAIN and self.signal_pending:
                self.signal_pending = False
                if self.interrupts.claim():  # the rank's SIGINT handler
                    self.raised_in.append(run.key if run is not None else "own code")
                    raise KeyboardInterrupt
            if thread != MAIN and thread in self.async_pending:
                self.async_pending.discard(thread)
                self.raised_in.append(run.key if run is not None else "own code")
                raise KeyboardInterrupt
        finally:
            if self.clock == self.stop_at:
                self.stopped_at = self.clock
                self.in_user_code_at_stop = {r.key for r in self.runs._begun.values() if r.depth > 0}
                self.stop(self.runs)
            self.clock += 1

    def user_lines(self, thread: int, run: Run, lines: int, last: bool, inside: Callable[[Run], None] | None) -> None:
        for n in range(lines):
            self.point(thread, run)
            if n == 1 and inside is not None:
                inside(run)  # (a call this user code waits on, served here or on another thread)
        if last:
            self.ended_user_code[run.key] = self.clock - 1  # (its last line: a stop during it comes too late)


@dataclass
class Outcome:
    results: dict[object, str] = field(default_factory=dict)  # run key -> "ok" / "stopped"


def a_run(rank: FakeRank, out: Outcome, key: object, kind: RunKind, thread: int, sections: int = 1,
          inside: Callable[[Run], None] | None = None) -> None:
    """A run as the rank does it: own code, `begin`, its user code in `sections`, own code, `end`, answer."""
    rank.point(thread)
    run = rank.runs.begin(key, kind, str(key), thread=thread)
    result = "ok"
    try:
        for section in range(sections):
            rank.point(thread)  # (the rank's own code for it: an autoreload check's set-up, say)
            last = section == sections - 1
            rank.runs.user_code(run, rank.user_lines, thread, run, 3, last, inside if last else None)
        rank.point(thread)
    except KeyboardInterrupt:
        result = "stopped"
    finally:
        rank.runs.end(run)
    rank.point(thread)  # (sending its answer)
    rank.runs.answered(key)
    out.results[key] = result


def two_requests(rank, out):
    a_run(rank, out, 1, RunKind.REQUEST, MAIN, sections=2)
    a_run(rank, out, 2, RunKind.REQUEST, MAIN, sections=2)


def two_calls_on_own_thread(rank, out):
    a_run(rank, out, (7, 1), RunKind.ENDPOINT, OWN)
    a_run(rank, out, (7, 2), RunKind.ENDPOINT, OWN)


def call_on_main_then_request(rank, out):
    a_run(rank, out, (7, 1), RunKind.ENDPOINT, MAIN)
    a_run(rank, out, 2, RunKind.REQUEST, MAIN)


def request_serving_a_call_in_its_wait(rank, out):
    a_run(rank, out, 1, RunKind.REQUEST, MAIN, sections=2,
          inside=lambda outer: served_in_the_wait(rank, out, (7, 1), outer))
    a_run(rank, out, 2, RunKind.REQUEST, MAIN)


def served_in_the_wait(rank, out, key, outer):
    """A call the run's wait serves on its own thread (`ActorHost.wait_for`): the rank's code around it."""
    rank.point(MAIN, outer)  # (the wait, in the user code: a stop of the waiting run lands here)
    with rank.runs.rank_code(MAIN):
        a_run(rank, out, key, RunKind.ENDPOINT, MAIN)
    rank.point(MAIN, outer)


def request_beside_a_call_on_its_thread(rank, out):
    a_run(rank, out, 1, RunKind.REQUEST, MAIN,
          inside=lambda outer: a_run(rank, out, (7, 1), RunKind.ENDPOINT, OWN))
    a_run(rank, out, (7, 2), RunKind.ENDPOINT, OWN)


SCENARIOS = {f.__name__: f for f in (two_requests, two_calls_on_own_thread, call_on_main_then_request,
                                     request_serving_a_call_in_its_wait, request_beside_a_call_on_its_thread)}
NESTED = {(7, 1): 1}  # the call served inside request 1's wait (request_serving_a_call_in_its_wait)


def points_of(scenario) -> tuple[int, list[object]]:
    rank, out = FakeRank(-1, lambda runs: None), Outcome()
    scenario(rank, out)
    assert set(out.results.values()) == {"ok"} and rank.raised_in == []
    return rank.clock, list(out.results)


def schedules():
    for name, scenario in SCENARIOS.items():
        points, keys = points_of(scenario)
        for stop_at in range(points + 1):
            for target in [*keys, "running"]:
                yield pytest.param(name, stop_at, target, id=f"{name}-{stop_at}-{target}")


def stopper(target) -> Callable[[Runs], None]:
    """The notebook's stop of one run (by its key), or its stop button ("running": whatever runs now)."""
    if target == "running":
        return lambda runs: runs.stop(running=True)
    return lambda runs: runs.stop([target])


def cases():
    return list(schedules())


@pytest.mark.parametrize("name,stop_at,target", cases())
def test_a_stop_at_any_moment_reaches_exactly_its_run(name, stop_at, target):
    scenario = SCENARIOS[name]
    rank, out = FakeRank(stop_at, stopper(target)), Outcome()
    scenario(rank, out)
    for _ in range(3):  # (idle lines after the work: nothing may come now)
        rank.point(MAIN)
        rank.point(OWN)

    assert "own code" not in rank.raised_in
    assert len(rank.raised_in) == len(set(rank.raised_in))  # (once per run at most)
    assert not rank.signal_pending and not rank.async_pending and rank.interrupts.resend() == 0
    if rank.stopped_at is None:  # (the stop came after the last line)
        assert set(out.results.values()) == {"ok"}
        return
    targets = rank.in_user_code_at_stop if target == "running" else {target}
    stopped = {key for key, result in out.results.items() if result == "stopped"}
    # whom it may reach: its targets, and a call that a target's wait serves on its thread
    reachable = targets | {inner for inner, outer in NESTED.items() if outer in targets and name.startswith("request_serving")}
    assert stopped <= reachable, f"stopped {stopped}, the stop was for {targets}"
    assert set(rank.raised_in) <= reachable
    for key in targets:
        if key not in out.results:
            continue
        came_before_its_user_code_ended = rank.stopped_at < rank.ended_user_code[key] if key in rank.ended_user_code else True
        if came_before_its_user_code_ended:  # it ends stopped (or the call its wait serves does)
            assert stopped & ({key} | {inner for inner, outer in NESTED.items() if outer == key}), \
                f"{key} was not stopped ({out.results})"
        else:  # dropped: its user code had ended
            assert out.results[key] == "ok"


def test_every_scenario_has_schedules_where_the_stop_lands_in_user_code_and_where_it_is_dropped():
    landed, dropped = 0, 0
    for param in cases():
        name, stop_at, target = param.values
        rank, out = FakeRank(stop_at, stopper(target)), Outcome()
        SCENARIOS[name](rank, out)
        landed += bool(rank.raised_in)
        dropped += rank.stopped_at is not None and not rank.raised_in and "stopped" not in out.results.values()
    assert landed > 50 and dropped > 50


def test_a_stop_before_its_request_arrives_stops_it_as_it_starts():
    rank, out = FakeRank(0, lambda runs: runs.stop([2])), Outcome()
    two_requests(rank, out)
    assert out.results == {1: "ok", 2: "stopped"} and rank.raised_in == []  # (raised by `user_code`, not a signal)


def test_a_stop_button_with_nothing_running_is_a_no_op():
    rank, out = FakeRank(0, lambda runs: runs.stop(running=True)), Outcome()
    two_requests(rank, out)
    assert out.results == {1: "ok", 2: "ok"} and not rank.signal_pending and rank.interrupts.resend() == 0


def test_a_collective_broken_by_a_stop_counts_as_stopped_only_in_a_request_being_stopped():
    """On a loaded machine a peer's stop may end a rank's collective before its own stop comes: that rank
    fails with gloo's RuntimeError. In a request the notebook was stopping, where the rank said its
    collective was ended, that is the stop's doing (MeshInterrupted); elsewhere it is the cell's error."""
    from monarch_kernel.api.futures import failure_kind
    from monarch_kernel.controller.state import Request
    from monarch_kernel.core.failures import FailureKind
    from monarch_kernel.wire.messages import Failure

    broken = Failure("RuntimeError", "Connection closed by peer", "")
    req = Request(7, frozenset(range(4)), "In[3]", fail_fast=False)
    req.aborted[1] = "its gloo process groups' connections closed"
    assert failure_kind(req, 1, broken) is FailureKind.EXCEPTION  # (nobody stopped it)
    req.stopping = True
    assert failure_kind(req, 1, broken) is FailureKind.INTERRUPTED
    assert failure_kind(req, 2, broken) is FailureKind.EXCEPTION  # (no collective of rank 2's was ended)
    assert failure_kind(req, 2, Failure("KeyboardInterrupt", "", "", interrupted=True)) is FailureKind.INTERRUPTED


def test_a_stop_that_ends_a_collective_says_so_at_once_not_only_with_the_runs_answer():
    """On a loaded machine the run may take seconds to unwind from the ended collective: the notebook hears at
    once that it will answer (and waits for it) and that the group must be made anew."""
    told: list[tuple[object, str]] = []

    class InACollective(FakeRank):
        def end_collective(self, thread: int) -> str:
            return "its gloo process groups' connections closed" if thread == MAIN else ""

    def stop(runs: Runs) -> None:
        runs.stop(running=True)
        assert told == [(1, "its gloo process groups' connections closed")]  # before the run ends

    rank, out = InACollective(3, stop), Outcome()
    rank.runs.on_collective_ended = lambda key, how: told.append((key, how))
    two_requests(rank, out)
    assert out.results == {1: "stopped", 2: "ok"} and len(told) == 1
