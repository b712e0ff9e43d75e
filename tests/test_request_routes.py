"""A request's two routes, driven in adversarial orders without any process: results on a rank's
direct lane, and the fd output (what C code wrote to fd 1/2) that comes through its agent.

The rule (controller/requests.py): a lane result says how much fd output came before it
(`fd_mark`); it is booked only once that much has reached the controller, so nothing a cell
wrote arrives after the cell ended; a result whose fd output never comes is released after
HELD_AT_MOST_S."""

import pytest
from conftest import wait_until

from monarch_kernel.controller.events import DoneEvent
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.requests import DiscardedOutput, RequestBook
from monarch_kernel.controller.router import ControllerSender
from monarch_kernel.controller.state import MeshState, RankState
from monarch_kernel.core.folders import release_folder
from monarch_kernel.wire import messages as m

pytestmark = pytest.mark.unit


@pytest.fixture
def book():
    state = MeshState("routes")
    for rank in (0, 1):
        state.ranks[rank] = RankState(rank, "h", rank)
        state.ranks[rank].started(1000 + rank)
    loop = ControllerLoop.get()
    book = RequestBook(state, loop, ControllerSender(state, loop), DiscardedOutput())
    yield book, state
    state.closed = True
    release_folder(state.run_dir)
    release_folder(state.shm_dir)


def submitted(book, state, ranks=(0, 1)):
    req = book.submit(ranks, lambda rid: m.Pull(rid, "1"), label="routes")  # (no agent: nothing is sent)
    assert wait_until(lambda: req.req_id in state.requests, 5)
    return req


def result(req, rank, fd_mark=0):
    return m.Result(req.req_id, rank, None, None, 0.0, 0.1, fd_mark)


def fd_output(req, rank, text, total):
    return m.Output(rank, req.req_id, "stdout", text, fd_total=total)


def events(req):
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def test_a_lane_result_waits_for_the_fd_output_it_says_came_first(book):
    book, state = book
    req = submitted(book, state)
    book._from_lane(result(req, 0, fd_mark=6))  # the lane is faster than the agent
    book._from_lane(result(req, 1))
    assert not req.done and 0 in req.held
    book.output(fd_output(req, 0, "from C", 6))
    assert req.done
    shown = events(req)
    assert [type(e) for e in shown] == [m.Output, DoneEvent] and shown[0].text == "from C"  # the output first


def test_fd_output_before_its_result_books_the_result_at_once(book):
    book, state = book
    req = submitted(book, state)
    book.output(fd_output(req, 0, "early", 5))
    book._from_lane(result(req, 0, fd_mark=5))
    book._from_lane(result(req, 1))
    assert req.done and not req.held


def test_a_result_whose_fd_output_never_comes_is_released_after_a_while(book):
    book, state = book
    req = submitted(book, state)
    book._from_lane(result(req, 0, fd_mark=9))
    book._from_lane(result(req, 1))
    book.release_overdue(req, after=60.0)
    assert not req.done  # not yet
    book.release_overdue(req, after=0.0)  # (HELD_AT_MOST_S later)
    assert req.done and 0 in req.results


def test_a_late_fd_output_of_an_ended_request_is_idle_output_not_the_next_requests(book):
    book, state = book
    first = submitted(book, state)
    book._from_lane(result(first, 0))
    book._from_lane(result(first, 1))
    assert first.done
    second = submitted(book, state)
    book.output(fd_output(first, 0, "late", 3))  # it names the first request, which is over
    assert not any(isinstance(e, m.Output) for e in events(second))
    book._from_lane(result(second, 0, fd_mark=3))  # already seen: booked at once
    book._from_lane(result(second, 1))
    assert second.done


def test_a_rank_that_dies_with_a_held_result_completes_the_request(book):
    book, state = book
    req = submitted(book, state)
    book._from_lane(result(req, 0, fd_mark=4))  # held for fd output that its death will never send
    book._from_lane(result(req, 1))
    book.rank_exited(0, 9, "SIGKILL", (), expected=False)
    assert req.done and 0 in req.results  # it had answered: its answer stands
