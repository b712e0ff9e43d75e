"""Which thread runs user code on a rank (`rank/user_threads.py`), in the unit tier: a thread of the test
plays the rank's main thread (`serve()`), and jobs record the thread they ran on."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

from monarch_kernel.rank.user_threads import UserThreads


@pytest.fixture
def threads():
    threads = UserThreads("test-own-")
    main = threading.Thread(target=threads.serve, name="fake-main", daemon=True)
    main.start()
    yield threads
    threads.close()
    main.join(10)
    assert not main.is_alive()


def recorder(ran: list[str], gate: threading.Event | None = None):
    def job():
        ran.append(threading.current_thread().name)
        if gate is not None:
            assert gate.wait(10)
    return job


def test_a_sync_call_runs_on_the_main_thread_when_it_is_free(threads):
    ran: list[str] = []
    threads.place("a#1", recorder(ran))
    assert wait_until(lambda: ran == ["fake-main"], 10)
    assert wait_until(threads.idle, 10)


def test_while_the_main_thread_is_busy_calls_run_on_their_actors_own_threads_in_order(threads):
    gate, ran, own = threading.Event(), [], []
    threads.submit(recorder(ran, gate))  # a request holds the main thread
    assert wait_until(lambda: ran == ["fake-main"], 10) and not threads.idle()
    for _ in range(3):
        threads.place("a#1", recorder(own))
    threads.place("b#2", recorder(own))
    assert wait_until(lambda: len(own) == 4, 10)
    assert own.count("test-own-a#1") == 3 and own.count("test-own-b#2") == 1
    gate.set()
    assert wait_until(threads.idle, 10)
    threads.place("a#1", recorder(ran))  # free again: the main thread takes it
    assert wait_until(lambda: ran == ["fake-main", "fake-main"], 10)


def test_release_frees_the_main_thread_and_keep_takes_it_back_only_if_nothing_came_meanwhile(threads):
    answers: list[bool] = []
    can_go, released = threading.Event(), threading.Event()

    def serving():
        threads.release()  # its user code ended: the next call may go elsewhere...
        released.set()
        assert can_go.wait(10)
        answers.append(threads.keep())  # ...or on here, if none did

    threads.submit(serving)
    assert released.wait(10) and threads.idle()
    can_go.set()
    assert wait_until(lambda: answers == [True], 10)

    answers.clear()
    can_go.clear()
    released.clear()
    ran: list[str] = []
    threads.submit(serving)
    assert released.wait(10)
    threads.place("a#1", recorder(ran))  # the main thread counted as free: given to it, after this job
    can_go.set()
    assert wait_until(lambda: answers == [False] and ran == ["fake-main"], 10)


def test_an_ended_actors_own_thread_ends_after_what_it_was_given(threads):
    gate, ran, own = threading.Event(), [], []
    threads.submit(recorder(ran, gate))
    assert wait_until(lambda: ran, 10)
    threads.place("ended#9", recorder(own))
    assert wait_until(lambda: own == ["test-own-ended#9"], 10)
    assert len(threads.own_idents) == 1
    threads.end("ended#9")
    assert wait_until(lambda: not threads.own_idents, 10)
    assert wait_until(lambda: not any(t.name == "test-own-ended#9" for t in threading.enumerate()), 10)
    gate.set()


def test_a_job_that_raises_leaves_the_threads_serving(threads):
    gate, ran = threading.Event(), []

    def fails():
        raise KeyboardInterrupt  # (a stop that came as the job ended)

    threads.submit(fails)
    threads.submit(recorder(ran))
    assert wait_until(lambda: ran == ["fake-main"], 10)
    threads.submit(recorder(ran, gate))
    assert wait_until(lambda: len(ran) == 2, 10)
    threads.place("a#1", fails)
    threads.place("a#1", recorder(ran))
    assert wait_until(lambda: ran[-1] == "test-own-a#1", 10)
    gate.set()
    assert wait_until(threads.idle, 10)
