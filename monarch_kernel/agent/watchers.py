"""The host agent's watchers: its ranks' heartbeats and loads, its own heartbeat to the
controller, and (over SSH) the controller's silence."""

from __future__ import annotations

import asyncio
import time

from monarch_kernel.agent.host_agent import HostAgent
from monarch_kernel.wire import messages as m


async def watch_ranks(agent: HostAgent) -> None:
    """Ping every rank; send loads about once a second while the controller answers."""
    while True:
        await asyncio.sleep(agent.ranks.health.heartbeat_interval_s)
        now = time.monotonic()
        # loads only while the controller answers: a link gone quiet gets no traffic from
        # us, so the SSH server's own keepalive can notice it and end the session
        every = agent.ranks.health.ping_interval_s
        if now - agent.last_load >= every and now - agent.last_heard < 2 * every:
            agent.send_loads()
        agent.ranks.ping(now)


async def send_heartbeats(agent: HostAgent) -> None:
    """Tell the controller we are alive every ping interval, unasked: its pings can wait for seconds
    behind a large frame it is sending us (a push), and its silence timer must not count those."""
    while True:
        await asyncio.sleep(agent.ranks.health.ping_interval_s)
        agent.to_controller(m.Pong(0))


async def watch_controller(agent: HostAgent) -> None:
    """If the controller falls silent for controller_silence_s, stop every rank (SSH agents only; a
    persistent mesh lets that controller go and waits for the next).

    A busy kernel is silent too (a C call holding the GIL stops its pings), so the limit
    is long; a local agent needs no watchdog: it dies with the kernel (PDEATHSIG) and
    sees its socket close.
    """
    while True:
        await asyncio.sleep(agent.ranks.health.heartbeat_interval_s)
        silent = time.monotonic() - agent.last_heard
        if agent.persistence is not None and agent.controller is None:
            continue  # no kernel holds the mesh: nobody to hear from
        if silent > agent.ranks.health.controller_silence_s and agent.persistence is not None:
            link, agent.controller = agent.controller, None  # the mesh waits for the next kernel
            agent.persistence.detach(f"no message from the controller for {silent:.1f} s")
            if link is not None:
                link.close()
        elif silent > agent.ranks.health.controller_silence_s:
            await agent.shutdown(f"no message from the controller for {silent:.1f} s")
            return
