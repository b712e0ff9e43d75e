"""Actor call bookkeeping and routing, in memory: trackers, pending calls, the router of agents and controllers."""

import asyncio
import threading

import pytest

from monarch_kernel.wire.calls import CallTable, CallTracker, death_reply
from monarch_kernel.wire.messages import CONTROLLER, ActorCall, ActorReply, CancelCall
from monarch_kernel.wire.routing import CallRouter
from monarch_kernel.wire.serialization import seal

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def call(caller, call_id, ranks):
    return ActorCall(caller, call_id, "actor#1", "step", seal(((), {})), tuple(ranks), True)


def reply(caller, call_id, rank):
    return ActorReply(caller, call_id, rank, seal(rank), None, 0.1)


def test_tracker_knows_who_owes_what_and_refuses_duplicates():
    owed = CallTracker()
    owed.add(-1, 1, [0, 1])
    owed.add(5, 2, [1])
    assert owed.owed_by(1) == [(-1, 1), (5, 2)]
    assert owed.answered(-1, 1, 1) is True
    assert owed.answered(-1, 1, 1) is False  # a duplicate
    assert owed.answered(-1, 1, 3) is False  # never owed
    assert owed.owed_by(1) == [(5, 2)] and owed.owed_by(0) == [(-1, 1)]


def test_pending_call_wakes_threads_and_tasks():
    table = CallTable()
    pending = table.new((0, 1), "Actor.step")
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(pending.wait(2, timeout=10)))
    waiter.start()

    async def await_it():
        await asyncio.wait_for(pending.wait_async(2), 10)
        return "task"

    async def main():
        task = asyncio.ensure_future(await_it())
        await asyncio.sleep(0)
        threading.Thread(target=lambda: [table.deliver(reply(CONTROLLER, pending.call_id, r)) for r in (1, 0)]).start()
        return await task

    assert asyncio.run(main()) == "task"
    waiter.join(10)
    assert woke == [True] and pending.arrivals == [1, 0] and pending.done()
    assert table.pending() == []  # forgotten once every rank answered
    assert pending.wait(3, timeout=0.01) is False  # more replies than ranks never come


def test_failing_a_rank_answers_its_calls_with_its_death():
    table = CallTable()
    first, second = table.new((0, 1), "A.x"), table.new((1,), "A.y")
    table.fail_rank(1, "rank 1 died")
    assert first.replies[1].failure.error_type == "RankDied" and not first.done()
    assert second.done() and second.replies[1].failure.message == "rank 1 died"


class Hop:
    """A next hop that records what it was given."""

    def __init__(self):
        self.sent = []

    def __call__(self, msg):
        self.sent.append(msg)


def agent_router(local, alive, upstream):
    hops = {r: Hop() for r in local}
    router = CallRouter(next_hop=lambda r: hops[r] if r in alive else None, serves=lambda r: r in local,
                        why_dead=lambda r: f"rank {r} is not running", upstream=upstream)
    return router, hops


def test_an_agent_router_delivers_here_forwards_the_rest_and_answers_for_the_dead():
    up = Hop()
    router, hops = agent_router(local={0, 1, 2}, alive={0, 1}, upstream=up)
    router.call(call(caller=0, call_id=1, ranks=(1, 2, 5)))  # from rank 0: 1 here, 2 dead, 5 elsewhere
    assert [m.ranks for m in hops[1].sent] == [(1,)]
    assert [(m.rank, m.failure.message) for m in hops[0].sent] == [(2, "rank 2 is not running")]  # to the caller
    assert [m.ranks for m in up.sent] == [(5,)]
    router.reply(reply(0, 1, 1), owed=True)
    assert hops[0].sent[-1].rank == 1
    router.reply(reply(0, 1, 1), owed=True)  # late duplicate: dropped
    assert len(hops[0].sent) == 2


def test_a_call_from_above_never_goes_back_up():
    up = Hop()
    router, hops = agent_router(local={0, 1}, alive={0, 1}, upstream=up)
    router.call(call(caller=CONTROLLER, call_id=3, ranks=(0, 7)), from_above=True)
    assert [m.ranks for m in hops[0].sent] == [(0,)]
    assert [(m.rank, m.failure.error_type) for m in up.sent] == [(7, "RankDied")]  # answered, not forwarded


def test_a_rank_death_answers_every_call_it_owed():
    up = Hop()
    router, hops = agent_router(local={0, 1}, alive={0, 1}, upstream=up)
    router.call(call(caller=CONTROLLER, call_id=4, ranks=(0, 1)), from_above=True)
    router.call(call(caller=0, call_id=5, ranks=(1,)))
    router.rank_died(1, "rank 1 died (killed by SIGKILL)")
    assert [(m.caller, m.call_id, m.failure.message) for m in up.sent] == \
        [(CONTROLLER, 4, "rank 1 died (killed by SIGKILL)")]
    assert [(m.call_id, m.failure.error_type) for m in hops[0].sent if isinstance(m, ActorReply)] == [(5, "RankDied")]
    router.reply(reply(CONTROLLER, 4, 1), owed=True)  # the dead rank's late answer is dropped
    assert len(up.sent) == 1


def test_a_controller_router_groups_by_host_and_keeps_its_own_replies():
    host_a, host_b = Hop(), Hop()
    link_of = {0: host_a, 1: host_a, 2: host_b, 3: None}  # rank 3's host is gone
    mine = []
    router = CallRouter(next_hop=link_of.get, serves=lambda r: r in link_of, why_dead=lambda r: f"rank {r} is dead",
                        deliver_here=mine.append, here_id=CONTROLLER)
    router.call(call(CONTROLLER, 8, (0, 1, 2, 3)))
    assert [m.ranks for m in host_a.sent] == [(0, 1)] and [m.ranks for m in host_b.sent] == [(2,)]
    assert [(m.rank, m.failure.message) for m in mine] == [(3, "rank 3 is dead")]
    router.call(call(caller=2, call_id=9, ranks=(0,)))  # rank 2 calls rank 0 across hosts
    router.reply(reply(2, 9, 0), owed=True)
    assert host_b.sent[-1] == reply(2, 9, 0)  # back to the caller's host
    router.cancel(CancelCall(CONTROLLER, 8, (1, 2, 3)))
    assert host_a.sent[-1].ranks == (1,) and host_b.sent[-1].ranks == (2,)


def test_death_reply_names_the_rank():
    r = death_reply(4, 2, 1, "gone")
    assert (r.caller, r.call_id, r.rank, r.failure.error_type) == (4, 2, 1, "RankDied")
