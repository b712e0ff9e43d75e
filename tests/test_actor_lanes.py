"""An async actor's own lanes, in one process: its loop serves the calls other meshes' ranks send there,
and when it ends, its lanes are retired to the rank's loop without losing or repeating a call.

Real Unix sockets, the rank's real `ActorLoop` and `ActorLanes`, and the caller's real `DirectCalls`;
the endpoint is replaced by an answer that says which thread read the call."""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

import pytest

from monarch_kernel.rank.actor_lanes import ActorLanes
from monarch_kernel.rank.actor_loops import ActorLoop
from monarch_kernel.rank.direct_calls import DirectCalls, LaneRetiredError
from monarch_kernel.wire.lane_server import LaneServer, accept_lane, listen_lane
from monarch_kernel.wire.lanes import actor_lane_path, lane_path
from monarch_kernel.wire.messages import ActorCall, ActorReply, DirectRoute, FailureCause
from monarch_kernel.wire.serialization import seal, unseal

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)

ACTOR = "pong#1"
WAIT_S = 20.0


class RankLoop:
    """The rank's loop on a thread of its own, with its lane at rank-0.sock."""

    def __init__(self, folder: str, answer) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rank-loop", daemon=True)
        self.thread.start()
        self.listener = listen_lane(lane_path(folder, 0))
        self.servers: list[LaneServer] = []
        self._answer = answer
        self.loop.call_soon_threadsafe(self.loop.add_reader, self.listener.fileno(), self._accept)

    def _accept(self) -> None:
        sock = accept_lane(self.listener)
        if sock is not None:
            box: list[LaneServer] = []
            box.append(LaneServer(sock, self.loop, lambda msg: self._answer(msg, box[0].send)))
            self.servers.append(box[0])

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.listener.close()


def _answer(msg, reply) -> None:
    """An endpoint's stand-in: the reply says which thread read the call."""
    if isinstance(msg, ActorCall):
        reply(ActorReply(msg.caller, msg.call_id, 0, seal(threading.current_thread().name), None, 0.0))


class Replies:
    """What came back to the caller, by call id."""

    def __init__(self) -> None:
        self.by_call: dict[int, list[ActorReply]] = collections.defaultdict(list)
        self._cond = threading.Condition()

    def deliver(self, reply: ActorReply) -> None:
        with self._cond:
            self.by_call[reply.call_id].append(reply)
            self._cond.notify_all()

    def wait_for(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.by_call) >= count, WAIT_S), f"{len(self.by_call)} of {count}"

    def thread_of(self, call_id: int) -> str:
        (reply,) = self.by_call[call_id]
        assert reply.failure is None, reply.failure
        return unseal(reply.value)


@pytest.fixture
def lanes(tmp_path):
    """A rank's loop and lane, one async actor with its own loop and lanes, and a caller that knows the route."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    rank = RankLoop(str(folder), _answer)
    own = ActorLoop(ACTOR)
    ActorLanes(actor_lane_path(str(folder), 0, ACTOR), own, _answer, lambda: (rank.loop, rank.thread.ident or 0))
    replies = Replies()
    caller = DirectCalls(replies.deliver, "ping")
    caller.learn(DirectRoute((0,), "pong-mesh", str(folder), (0,)))
    yield folder, own, caller, replies
    own.close()
    rank.close()


def _call(call_id: int, actor: str = ACTOR) -> ActorCall:
    return ActorCall(0, call_id, actor, "ping", seal(((), {})), (0,), True, mesh="pong-mesh")


def test_a_call_to_an_async_actor_is_read_on_its_own_loop_and_a_sync_actors_on_the_ranks(lanes):
    _, own, caller, replies = lanes
    assert caller.send(_call(1)) and caller.send(_call(2, actor="sync#1"))
    replies.wait_for(2)
    assert replies.thread_of(1) == f"actor-loop-{ACTOR}"  # (no trip through the rank's loop)
    assert replies.thread_of(2) == "rank-loop"  # (no lane of its own: the rank's)


def test_calls_sent_while_the_actor_ends_are_each_answered_once_and_none_as_a_death(lanes):
    folder, own, caller, replies = lanes
    count = 3000
    sent: list[int] = []
    progress = threading.Condition()

    def send_all() -> None:
        for call_id in range(1, count + 1):
            assert caller.send(_call(call_id))
            with progress:
                sent.append(call_id)
                progress.notify_all()

    sender = threading.Thread(target=send_all)
    sender.start()
    replies.wait_for(count // 10)  # (the actor is serving them)
    held = threading.Event()

    def hold() -> None:  # its loop is held: calls pile up unread in its lane
        held.set()
        time.sleep(0.3)

    own.loop.call_soon_threadsafe(hold)
    assert held.wait(WAIT_S)
    with progress:
        held_at = len(sent)
        assert progress.wait_for(lambda: len(sent) >= min(held_at + 100, count), WAIT_S)
    own.close()  # the actor ends with calls unread in its lane, and more still being sent to it
    sender.join(WAIT_S)
    replies.wait_for(count)
    assert sent == list(range(1, count + 1))
    assert all(len(replies.by_call[call_id]) == 1 for call_id in sent)  # once each: none lost, none repeated
    threads = collections.Counter(replies.thread_of(call_id) for call_id in sent)  # (a death would fail here)
    assert threads[f"actor-loop-{ACTOR}"] >= count // 10
    assert threads["rank-loop"] > 0, threads  # those after its end: the rank answers them (in ours: "it ended")
    assert not os.path.exists(actor_lane_path(str(folder), 0, ACTOR))


def test_a_retired_lane_takes_no_new_call_and_closes_once_it_owes_nothing(lanes):
    _, own, caller, replies = lanes
    assert caller.send(_call(1))
    replies.wait_for(1)
    lane = caller._lane_for(_call(2), "pong-mesh", "", 0)
    own.close()
    deadline = time.monotonic() + WAIT_S
    while not lane.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane.retired and lane.closed
    with pytest.raises(LaneRetiredError):
        lane.send(_call(2))
    assert caller.send(_call(3))  # the next call takes the rank's lane
    replies.wait_for(2)
    assert replies.thread_of(3) == "rank-loop"
    assert not any(reply.failure is not None and reply.failure.cause is FailureCause.RANK_DIED
                   for answers in replies.by_call.values() for reply in answers)


def test_a_caller_that_connects_as_the_actor_ends_is_answered_by_the_rank(lanes):
    _, own, caller, replies = lanes
    stopping = threading.Event()

    def stop_then_hold() -> None:  # the loop's last turn: it ends after this, before it sees the new caller
        own.loop.stop()
        stopping.set()
        time.sleep(0.3)

    own.loop.call_soon_threadsafe(stop_then_hold)
    assert stopping.wait(WAIT_S)
    assert caller.send(_call(1))  # connects to the actor's lane (not accepted yet) and sends
    replies.wait_for(1)
    assert replies.thread_of(1) == "rank-loop"  # accepted as the actor ended, then served by the rank
