"""A stop of a rank's main thread is addressed to a run, not to the thread (issue 41): raised only
while that run is what the main thread runs, dropped once it has ended, never raised in the next."""

import signal
import threading
import time

import pytest
from conftest import wait_until

from monarch_kernel.rank.interrupts import MainThreadInterrupts

pytestmark = pytest.mark.unit


@pytest.fixture
def interrupts():
    stops = MainThreadInterrupts()

    def handler(signum, frame):
        if stops.claim():
            raise KeyboardInterrupt

    stops.handler = handler
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stops
    finally:
        wait_until(lambda: not stops._wanted, 10)  # (the follow-ups have ended)
        signal.signal(signal.SIGINT, previous)


def stop_from_the_reader(interrupts, *predicates):
    """What the rank's reader thread does when the notebook's stop comes (the main thread runs on meanwhile)."""
    return lambda: threading.Thread(target=interrupts.interrupt, args=predicates).start()


def run_until_stopped(seconds: float, first=lambda: None) -> bool:
    """first(), then Python code on the main thread for up to `seconds`; whether a KeyboardInterrupt came
    (a stop that comes as first() runs counts too)."""
    deadline = time.monotonic() + seconds
    try:
        first()
        while time.monotonic() < deadline:
            time.sleep(0.005)
    except KeyboardInterrupt:
        return True
    return False


def test_a_stop_for_the_run_on_the_main_thread_is_raised_in_it(interrupts):
    assert run_until_stopped(5, stop_from_the_reader(interrupts, lambda: True))


def test_a_stop_whose_run_has_ended_is_dropped_and_never_reaches_the_next_run(interrupts):
    running = {"cell": 2}  # the stop was for cell 1, which ended as the stop came: cell 2 runs
    assert not run_until_stopped(0.5, stop_from_the_reader(interrupts, lambda: running["cell"] == 1))
    assert wait_until(lambda: not interrupts._wanted, 5)  # dropped, not kept for later
    assert not run_until_stopped(0.3)


def test_a_stop_that_comes_while_the_ranks_own_code_runs_for_the_cell_waits_for_the_cells_code(interrupts):
    in_user_code = {"now": False}  # (the rank is sending the cell's output, say)
    stop = stop_from_the_reader(interrupts, lambda: True, lambda: in_user_code["now"])
    assert not run_until_stopped(0.3, stop)  # the rank's own code is not interrupted
    # the cell's code runs again: its stop reaches it (sent again until it is claimed)
    assert run_until_stopped(5, lambda: in_user_code.update(now=True))
