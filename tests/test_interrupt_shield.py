"""A stop that lands between a socket call and the bookkeeping of what it did (issue 41): the bytes
are neither sent twice nor lost, and the stop is still raised, right after. Each test makes the stop
land exactly there (the socket call itself raises it as it returns), on the main thread (SIGINT, the
notebook's stop button) and on another thread (the asynchronous stop of an actor's own thread)."""

import signal
import socket
import threading

import pytest

from monarch_kernel.core.interrupt_shield import shielded
from monarch_kernel.rank.thread_stops import stop_thread
from monarch_kernel.wire.lane_client import Lane
from monarch_kernel.wire.lanes import read_available
from monarch_kernel.wire.messages import Output
from monarch_kernel.wire.transport import BlockingConnection, FrameProtocol, encode

pytestmark = pytest.mark.unit


def interrupt_now() -> None:
    """What a stop does at this moment: SIGINT on the main thread, the async stop elsewhere."""
    if threading.current_thread() is threading.main_thread():
        signal.raise_signal(signal.SIGINT)
    else:
        stop_thread(threading.get_ident())


class StoppedAsItReturns(socket.socket):
    """A socket whose first `sendmsg` / `recv_into` is stopped just as the call returns."""

    stop_on = ""

    def sendmsg(self, buffers, *args):  # type: ignore[override]
        if self.stop_on == "send":  # (a part of the frame only, as a busy peer's full socket takes)
            buffers = [memoryview(buffers[0])[:1000]]
        sent = super().sendmsg(buffers, *args)
        if self.stop_on == "send":
            self.stop_on = ""
            interrupt_now()
        return sent

    def recv_into(self, *args):  # type: ignore[override]
        got = super().recv_into(*args)
        if self.stop_on == "recv":
            self.stop_on = ""
            interrupt_now()
        return got


def socket_pair(stop_on: str) -> tuple[StoppedAsItReturns, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stopped = StoppedAsItReturns(socket.AF_UNIX, socket.SOCK_STREAM, fileno=ours.detach())
    stopped.stop_on = stop_on
    return stopped, theirs


def frames_on(sock: socket.socket) -> list:
    """Every whole frame waiting on `sock`."""
    got: list = []
    sock.setblocking(False)
    read_available(sock, FrameProtocol(got.append, lambda exc: None), lambda exc: None, lambda: False)
    return got


def test_a_stop_as_a_lane_call_is_sent_raises_after_it_is_counted_and_it_is_never_sent_again():
    ours, theirs = socket_pair("send")
    lane = Lane(ours, lambda msg: None)
    call = Output(0, 1, "stdout", "run me once")
    with pytest.raises(KeyboardInterrupt):
        lane.send_chunks(encode(call))
    assert not lane.wants_write  # what was written is off the queue
    lane.flush()  # (the next write, which before sent the frame a second time)
    assert frames_on(theirs) == [call]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    lane.close()
    theirs.close()


def test_a_stop_as_a_lane_reads_loses_no_bytes_and_the_frames_stay_in_step():
    ours, theirs = socket_pair("recv")
    first, second = Output(0, 1, "stdout", "a" * 100), Output(0, 1, "stdout", "b" * 100)
    for msg in (first, second):
        theirs.sendall(b"".join(bytes(chunk) for chunk in encode(msg)))
    ours.setblocking(False)
    got: list = []
    reader = FrameProtocol(got.append, lambda exc: None)
    with pytest.raises(KeyboardInterrupt):
        read_available(ours, reader, lambda exc: None, lambda: False)
    read_available(ours, reader, lambda exc: None, lambda: False)
    assert got == [first, second]
    ours.close()
    theirs.close()


def test_a_stop_of_another_thread_as_it_sends_a_frame_lets_the_whole_frame_out_first():
    ours, theirs = socket_pair("send")
    conn = BlockingConnection(ours)
    msg = Output(0, 1, "stdout", "x" * 4096)
    outcome: list = []

    def an_actors_thread() -> None:
        try:
            conn.send(msg)
            outcome.append("returned")
        except KeyboardInterrupt:
            outcome.append("stopped")
        conn.send(Output(0, 1, "stdout", "next"))  # the stream is still in step

    thread = threading.Thread(target=an_actors_thread)
    thread.start()
    thread.join(10)
    assert outcome == ["stopped"]
    assert frames_on(theirs) == [msg, Output(0, 1, "stdout", "next")]
    conn.close()
    theirs.close()


def test_a_stop_held_during_a_section_of_another_thread_is_raised_when_it_ends_and_only_then():
    inside, go = threading.Event(), threading.Event()
    seen: list = []

    def section() -> None:
        inside.set()
        go.wait(10)
        seen.append("section ended")

    def a_thread() -> None:
        try:
            shielded(section)
            seen.append("no stop")
        except KeyboardInterrupt:
            seen.append("stopped after")

    thread = threading.Thread(target=a_thread)
    thread.start()
    assert inside.wait(10)
    stop_thread(thread.ident)
    go.set()
    thread.join(10)
    assert seen == ["section ended", "stopped after"]


def test_the_main_threads_own_handler_runs_for_a_sigint_that_came_during_a_section():
    calls: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        assert shielded(lambda: (signal.raise_signal(signal.SIGINT), calls.append("body"))[1] is None) is True
        assert calls == ["body", signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)



def test_a_handler_that_notes_stops_itself_stays_installed_and_runs_once_as_the_section_ends():
    """The rank's own handler (`notes_in_sections`): no handler change per reply, and a stop during the write
    still waits for the write and its count, then reaches the handler."""
    from monarch_kernel.core import interrupt_shield

    calls: list = []

    def rank_handler(signum, frame):
        if interrupt_shield.noted_in_section(signum, frame):
            calls.append("noted")
            return
        calls.append("handled")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, rank_handler)
    interrupt_shield.notes_in_sections(rank_handler)
    try:
        def section() -> None:
            assert signal.getsignal(signal.SIGINT) is rank_handler  # left in place
            signal.raise_signal(signal.SIGINT)
            calls.append("body")

        with pytest.raises(KeyboardInterrupt):
            shielded(section)
        assert calls == ["noted", "body", "handled"]
        calls.clear()
        ours, theirs = socket_pair("send")  # and a reply's write stopped as sendmsg returns: sent once, whole
        lane = Lane(ours, lambda msg: None)
        call = Output(0, 1, "stdout", "once")
        with pytest.raises(KeyboardInterrupt):
            lane.send_chunks(encode(call))
        lane.flush()
        assert frames_on(theirs) == [call] and calls == ["noted", "handled"]
        lane.close()
        theirs.close()
    finally:
        interrupt_shield.notes_in_sections(None)
        signal.signal(signal.SIGINT, previous)
