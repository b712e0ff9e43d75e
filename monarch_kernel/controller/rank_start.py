"""Starting the ranks of a mesh whose agents are connected: the rendezvous store, the relay tree
for many hosts, then each host's ranks, until every rank said it is up (loop thread only)."""

from __future__ import annotations

import asyncio
from typing import Any

from monarch_kernel.controller.relays import ControllerRelays
from monarch_kernel.controller.state import HostLink, MeshSpec, MeshState
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.wire import messages as m


def start_failure(exc: BaseException) -> str:
    """A host's start-up failure, for the line naming that host."""
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("host ") and ": " in text else (text or type(exc).__name__)


def quiet_future(loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
    """A future whose failure may go unawaited (a host failing while the start is aborted)."""
    future = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


async def start_ranks(state: MeshState, spec: MeshSpec, relays: ControllerRelays) -> None:
    """Have every connected agent start its ranks (after each said hello); until all are up."""
    links = state.links
    try:
        await asyncio.wait_for(asyncio.gather(*(link.greeted for link in links if link.greeted is not None)),
                               spec.start_timeout_s)
    except TimeoutError:
        raise MeshStartError(f"mesh {state.name!r}: no agent answered within {spec.start_timeout_s:.0f} s; "
                             f"see the agent logs in {state.run_dir}") from None
    hosts = [link.host for link in links if link.host is not None]
    assert len(hosts) == len(links), "every host is connected before its ranks start"
    master = spec.master_addr or hosts[0].address
    dist = m.DistConfig(spec.backend, master, len(links) * spec.gpus)
    loop = asyncio.get_running_loop()
    started = []
    for link in links:
        if link.started is None or link.started.done():
            link.started = quiet_future(loop)  # fails if the agent is lost meanwhile
        started.append(link.started)
    # one host: its ranks meet in a FileStore there; several: rank 0's TCPStore on MASTER_ADDR
    multi_host = spec.backend != "none" and len(links) > 1
    port = await bind_store(state.name, links[0], started[0], master) if multi_host else 0
    if not relays.active:  # (a restart that kept every agent keeps their tree)
        await relays.setup(links)
        state.relay_route = relays.route if relays.active else None
    for link, host in zip(links, hosts):
        specs = tuple(m.RankSpec(r, i, spec.gpus, spec.proc_bind[i] if spec.proc_bind else (),
                                 spec.rank_env[r] if spec.rank_env else ())
                      for i, r in enumerate(link.ranks))
        link.send(m.StartRanks(ranks=specs, dist=dist, env=dict(spec.env),
                               shm_dir=state.shm_dir if host.is_local else None,
                               node_rank=link.index, master_port=port, health=spec.health, mesh=state.name))
    try:
        infos = await asyncio.wait_for(asyncio.gather(*started), spec.start_timeout_s)
    except TimeoutError:
        raise MeshStartError(
            f"mesh {state.name!r} did not start within {spec.start_timeout_s:.0f} s; "
            f"see the agent log in {state.run_dir}") from None
    for batch in infos:
        for info in batch:
            state.ranks[info.rank].started(info.pid)

async def bind_store(name: str, first: HostLink, started: asyncio.Future[Any], master: str) -> int:
    """Have host 0's agent bind the rendezvous store; its port."""
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    first.store_port = port
    first.send(m.BindStore(master))
    await asyncio.wait([port, started], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if not port.done():
        if started.done():
            started.result()  # raises why the host failed
        raise MeshStartError(f"mesh {name!r}: host {first.name} did not bind the rendezvous store")
    return port.result()
