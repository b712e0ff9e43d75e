"""An in-memory host agent for unit tests of the controller: it speaks the real protocol.

Each message crosses the in-memory link encoded and decoded as on a socket, so every
message must pickle as it would in production. The agent's behaviour is scripted: ranks
"run" cells by answering with their rank number times ten, and the test can kill ranks,
make ranks unresponsive, or make the whole host fall silent.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from monarch_kernel import __version__
from monarch_kernel.controller.hosts import HostConnection
from monarch_kernel.wire import handshake
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.serialization import seal
from monarch_kernel.wire.transport import decode, encode

_pids = itertools.count(40_000)


def _roundtrip(msg: Any) -> Any:
    """A message as the other end of a socket would see it."""
    chunks = [bytes(c) for c in encode(msg)]
    from monarch_kernel.wire.transport import _FLAT, _HEAD, _LEN

    meta_len, count = _HEAD.unpack_from(chunks[0])
    nbufs = count & ~_FLAT
    start = _HEAD.size + nbufs * _LEN.size
    return decode(chunks[0][start:start + meta_len], [bytearray(c) for c in chunks[1:]], bool(count & _FLAT))


class MemoryLink:
    """The controller's end of an in-memory agent (what AsyncConnection offers)."""

    def __init__(self, agent: AgentDouble):
        self.agent = agent
        self.closed = False
        self.bytes_sent = 0
        self.last_received = 0.0  # whole messages only: no partly arrived frame shows life here

    def backlog(self) -> int:
        return 0  # nothing queued: the double takes every message at once

    def send(self, msg: Any) -> None:
        if self.closed:
            return
        decoded = _roundtrip(msg)
        self.agent.loop.call_soon(self.agent.receive, decoded)

    def send_chunks(self, chunks: list[Any]) -> None:
        raise AssertionError("the controller sends whole messages to agents")

    def close(self) -> None:
        self.closed = True
        self.agent.closed.set()  # as an agent exits when its input ends


class AgentDouble:
    """A scripted host agent behind an in-memory link."""

    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.get_running_loop()
        self.received: list[Any] = []
        self.pids: dict[int, int] = {}
        self.silent = False  # stop answering (a host cut off the network)
        self.hold: set[int] = set()  # ranks whose requests run until interrupted (busy)
        self.held: dict[int, int] = {}  # rank -> the request it is busy with
        self.link: MemoryLink | None = None
        self._on_message: Any = None
        self._on_close: Any = None
        self.closed = asyncio.Event()
        self.greeting: Any = handshake.hello(__version__)

    # what HostConnection expects of a remote agent (controller/hosts.AgentHandle)
    scheduled = False

    def job_ended(self) -> str:
        return ""

    def lost_reason(self) -> str:
        return ""

    def attach(self, on_message: Any, on_close: Any) -> MemoryLink:
        self._on_message, self._on_close = on_message, on_close
        self.link = MemoryLink(self)
        self.loop.call_soon(self.say, self.greeting)  # an agent's first frame: its version
        return self.link

    async def wait_closed(self) -> None:
        await self.closed.wait()

    def close(self) -> None:
        self.closed.set()

    async def remove_shipped(self) -> None:
        return None  # nothing was shipped to an in-memory host

    async def explain_exit(self) -> str:
        return f"the agent on {self.name} went away"

    # talking to the controller
    def say(self, msg: Any) -> None:
        if not self.silent and self.link is not None and not self.link.closed:
            self._on_message(_roundtrip(msg))

    def receive(self, msg: Any) -> None:
        self.received.append(msg)
        if self.silent:
            return
        if isinstance(msg, m.Ping):
            self.say(m.Pong(msg.seq))
        elif isinstance(msg, m.BindStore):
            self.say(m.StoreBound(29_500))
        elif isinstance(msg, m.StartRanks):
            self.pids = {spec.rank: next(_pids) for spec in msg.ranks}
            self.say(m.RanksStarted(tuple(m.RankInfo(r, pid, self.name) for r, pid in self.pids.items())))
        elif isinstance(msg, m.ToRanks):
            self._run(msg)
        elif isinstance(msg, m.ActorCall):
            for rank in msg.ranks:
                self.say(m.ActorReply(msg.caller, msg.call_id, rank, seal(f"{msg.endpoint} on {rank}"), None, 0.0))
        elif isinstance(msg, m.InterruptRanks):
            for rank in msg.ranks:  # an interrupt ends a busy rank's request with KeyboardInterrupt
                req_id = self.held.get(rank)
                if req_id is not None and (msg.running or req_id in msg.req_ids):
                    del self.held[rank]
                    failure = m.Failure("KeyboardInterrupt", "interrupted", "", interrupted=True)
                    self.say(m.Gathered(req_id, (m.Result(req_id, rank, None, failure, 1.0, 1.5),)))
        elif isinstance(msg, m.Shutdown):
            self.closed.set()

    def _run(self, msg: m.ToRanks) -> None:
        body = msg.body
        results = []
        for rank in msg.ranks:
            if rank in self.hold:
                self.held[rank] = body.req_id
                continue
            self.say(m.Output(rank, body.req_id, "stdout", f"hello from {rank}\n"))
            results.append(m.Result(body.req_id, rank, seal(rank * 10), None, 1.0, 1.5))
        self.say(m.Gathered(body.req_id, tuple(results)))

    # what the test does to the host
    def kill(self, rank: int, signal: str = "SIGKILL") -> None:
        self.say(m.RankExited(rank, self.pids[rank], None, signal, ("Fatal Python error",), False))

    def unresponsive(self, rank: int) -> None:
        self.say(m.RankHealth(rank, False))


def opener(agents: dict[str, AgentDouble], greeting: Any = None) -> Any:
    """A host opener (MeshRuntime's `opener`) that starts in-memory agents, kept in `agents`."""

    async def open_double(spec: Any, *, log_path: str, env: dict[str, str], **_: Any) -> HostConnection:
        agent = agents[spec.name] = AgentDouble(spec.name)
        if greeting is not None:
            agent.greeting = greeting
        return HostConnection(None, f"198.18.0.{len(agents)}", remote=agent)

    return open_double
