"""Direct lanes in one process: a rank's LaneServer and the notebook's LanePool over a real Unix socket."""

import asyncio
import os
import threading

import pytest

from monarch_kernel.wire.calls import CallTable
from monarch_kernel.wire.lane_client import LanePool
from monarch_kernel.wire.lane_server import LaneServer, accept_lane, listen_lane
from monarch_kernel.wire.lanes import lane_path
from monarch_kernel.wire.messages import CONTROLLER, ActorCall, ActorReply
from monarch_kernel.wire.serialization import seal, unseal
from monarch_kernel.wire.transport import encode

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


class Loop:
    """An asyncio loop on its own thread (the rank's, or the controller's)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def lane_dir(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    return str(private)


@pytest.fixture
def rank0(lane_dir):
    """Rank 0's end: answers each call with its call id, as an endpoint would."""
    rank_loop = Loop()
    listener = listen_lane(lane_path(lane_dir, 0))
    servers = []

    def accept():
        sock = accept_lane(listener)
        if sock is None:
            return
        box = []

        def answer(msg):
            box[0].send(ActorReply(msg.caller, msg.call_id, 0, seal(msg.call_id), None, 0.0))

        box.append(LaneServer(sock, rank_loop.loop, answer))
        servers.append(box[0])

    rank_loop.loop.call_soon_threadsafe(rank_loop.loop.add_reader, listener.fileno(), accept)
    yield servers
    rank_loop.stop()
    listener.close()


def test_the_lane_socket_is_private_to_its_owner(lane_dir, rank0):
    assert os.stat(lane_path(lane_dir, 0)).st_mode & 0o777 == 0o600


def test_two_threads_waiting_on_one_lane_each_get_their_own_replies(lane_dir, rank0):
    controller = Loop()
    table = CallTable()
    pool = LanePool(lane_dir, controller.loop, lambda msg: table.deliver(msg))
    errors = []

    def caller(count):
        try:
            for _ in range(count):
                pending = table.new((0,), "Echo.id")
                lane = pool.get(0)
                pool.send(lane, encode(ActorCall(CONTROLLER, pending.call_id, "e#1", "id", seal(((), {})), (0,), True)))
                assert pool.wait((0,), pending.done, timeout=10) is True
                assert unseal(pending.replies[0].value) == pending.call_id
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(300,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == [] and not any(t.is_alive() for t in threads)
        assert pool.get(0).unanswered == 0  # every reply was counted once, whoever read it
    finally:
        pool.close()
        controller.stop()


def test_pipelined_calls_are_answered_in_order(lane_dir, rank0):
    controller = Loop()
    table = CallTable()
    pool = LanePool(lane_dir, controller.loop, lambda msg: table.deliver(msg))
    try:
        calls = [table.new((0,), "Echo.id") for _ in range(500)]
        lane = pool.get(0)
        for pending in calls:
            pool.send(lane, encode(ActorCall(CONTROLLER, pending.call_id, "e#1", "id", seal(((), {})), (0,), True)))
        assert pool.wait((0,), lambda: all(p.done() for p in calls), timeout=30) is True
        assert [unseal(p.replies[0].value) for p in calls] == [p.call_id for p in calls]
    finally:
        pool.close()
        controller.stop()


def test_a_rank_without_a_lane_is_waited_for_the_usual_way(lane_dir):
    controller = Loop()
    pool = LanePool(lane_dir, controller.loop, lambda msg: None)
    try:
        assert pool.get(3) is None  # nobody listens at rank-3.sock
        assert pool.wait((3,), lambda: False, timeout=0.01) is None
    finally:
        controller.stop()


def test_a_rank_sending_to_a_notebook_that_reads_nothing_waits_instead_of_piling_up(monkeypatch):
    """N14: the rank's reply queue grew without bound while the notebook did not read its lane."""
    import select
    import socket
    import time

    from monarch_kernel.wire import lane_server
    from monarch_kernel.wire.messages import Output

    monkeypatch.setattr(lane_server, "REPLY_HIGH_WATER", 1 << 20, raising=False)
    rank_loop = Loop()
    ours, theirs = socket.socketpair()
    made = threading.Event()
    box = []

    def make():
        box.append(LaneServer(ours, rank_loop.loop, lambda msg: None))
        made.set()

    rank_loop.loop.call_soon_threadsafe(make)
    assert made.wait(5)
    server, sent = box[0], []

    def flusher():  # a rank's output thread printing 8 MiB while nobody reads
        for _ in range(32):
            server.send(Output(0, None, "stdout", "x" * (256 << 10)))
            sent.append(1)

    thread = threading.Thread(target=flusher, daemon=True)
    thread.start()
    from conftest import wait_until

    assert wait_until(lambda: server.backlog_bytes() > 1 << 20, 10)  # the notebook reads nothing: it fills up
    assert len(sent) < 32 and server.backlog_bytes() < 3 << 20  # ... to the high-water mark, and waits there
    theirs.setblocking(False)
    got = 0
    deadline = time.monotonic() + 20
    while got < 32 * (256 << 10) and time.monotonic() < deadline:
        select.select([theirs], [], [], 1.0)  # until there is something to read
        try:
            got += len(theirs.recv(1 << 20))
        except BlockingIOError:
            pass
    thread.join(5)
    assert len(sent) == 32 and got >= 32 * (256 << 10)  # the reader read: everything went through
    rank_loop.stop()
    ours.close()
    theirs.close()
