"""A host agent survives failures in its own handling of a message (review N6): before, any
exception in a handler escaped into asyncio's transport, which closed the controller link, and
the agent stopped every rank of the host."""

import asyncio
import errno
import os
import socket

import torch

import monarch_kernel.agent.host_agent as host_agent
import monarch_kernel.agent.host_shm as host_shm
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.serialization import seal
from monarch_kernel.wire.transport import AsyncConnection


def _full_disk(path, **_):
    raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, ".owner"))


async def _agent_after(messages, patch, answered: int):
    """The agent's answers to `messages` and a ping, once both the pong and request `answered`'s Gathered came
    (a push is copied on a thread of its own: the pong may come first, on a loaded machine by far)."""
    received = []
    ours, theirs = socket.socketpair()
    agent = host_agent.HostAgent("host-x")
    agent.connected(await AsyncConnection.from_socket(theirs, agent.on_controller_message, agent.on_controller_closed))
    controller = await AsyncConnection.from_socket(ours, received.append, lambda exc: None)
    patch()
    for msg in messages:
        controller.send(msg)
    controller.send(m.Ping(1))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while loop.time() < deadline and not (any(isinstance(r, m.Pong) and r.seq == 1 for r in received)
                                          and any(isinstance(r, m.Gathered) and r.req_id == answered for r in received)):
        await asyncio.sleep(0.01)
    alive = not agent.done.done()
    await agent.shutdown("test over", asked=True)
    controller.close()
    return alive, received


def test_a_full_dev_shm_during_a_push_to_several_ranks_leaves_the_agent_running(monkeypatch):
    push = m.Push(7, seal({"w": torch.zeros(1 << 19)}))  # 2 MiB for ranks 0 and 1: written once to /dev/shm

    def patch():
        monkeypatch.setattr(host_shm, "owned_folder", _full_disk)

    alive, received = asyncio.run(_agent_after([m.ToRanks((0, 1), push)], patch, answered=7))
    assert alive  # it answered the ping after the push: the link and the ranks stayed
    problems = [r.text for r in received if isinstance(r, m.AgentProblem)]
    assert problems and "No space left on device" in problems[0]
    assert any(isinstance(r, m.Gathered) and r.req_id == 7 for r in received)  # the push still ends


def test_a_handler_that_raises_is_reported_and_the_request_ends(monkeypatch):
    agent_cls = host_agent.HostAgent
    real_init = agent_cls.__init__

    def init(self, host):
        real_init(self, host)
        self._from_controller[m.ToRanks] = lambda msg: (_ for _ in ()).throw(RuntimeError("a bug in our own handling"))

    monkeypatch.setattr(agent_cls, "__init__", init)
    alive, received = asyncio.run(_agent_after([m.ToRanks((0,), m.RunCell(5, "1", "<x>"))], lambda: None, answered=5))
    assert alive
    assert any("a bug in our own handling" in r.text for r in received if isinstance(r, m.AgentProblem))
    (gathered,) = [r for r in received if isinstance(r, m.Gathered) and r.req_id == 5]
    assert gathered.results[0].failure is not None and "could not pass this request on" in gathered.results[0].failure.message


def test_a_slow_copy_into_shared_memory_keeps_the_agent_answering_and_the_order(monkeypatch):
    """N5: a multi-rank push was copied into /dev/shm on the agent's loop (2.3 s/GiB): no pongs,
    no heartbeats meanwhile, and the controller declared the host lost."""
    import threading

    release_copy = threading.Event()
    real_share = host_shm.share

    def slow_share(sealed, folder):
        release_copy.wait(10)  # the copy of a large push
        return real_share(sealed, folder)

    async def scenario():
        received = []
        ours, theirs = socket.socketpair()
        agent = host_agent.HostAgent("host-x")
        agent.connected(await AsyncConnection.from_socket(theirs, agent.on_controller_message, agent.on_controller_closed))
        controller = await AsyncConnection.from_socket(ours, received.append, lambda exc: None)
        monkeypatch.setattr(host_shm, "share", slow_share)
        controller.send(m.ToRanks((0, 1), m.Push(7, seal({"w": torch.zeros(1 << 19)}))))
        controller.send(m.ToRanks((0, 1), m.RunCell(8, "1", "<x>")))  # sent after the push: must stay after it
        controller.send(m.Ping(1))
        loop = asyncio.get_running_loop()
        sent = loop.time()
        while not any(isinstance(r, m.Pong) and r.seq == 1 for r in received):
            assert loop.time() - sent < 5, "no pong while the push was being copied"
            await asyncio.sleep(0.01)
        assert not [r for r in received if isinstance(r, m.Gathered)]  # the copy is still going on
        release_copy.set()
        while len([r for r in received if isinstance(r, m.Gathered)]) < 2:
            assert loop.time() - sent < 10
            await asyncio.sleep(0.01)
        await agent.shutdown("test over", asked=True)
        controller.close()
        return [r.req_id for r in received if isinstance(r, m.Gathered)]

    assert asyncio.run(scenario()) == [7, 8]
