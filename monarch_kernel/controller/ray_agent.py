"""A host agent on a Ray node: started by the node's first rank slot (`agent/ray_slot.py`), then an
encrypted direct TCP link keyed by public keys that Ray carried both ways (`wire/pinned_auth`).

Ray is the placement engine, not the data path: after the start, cells, transfers and replies go
over our own link to the node, as for SSH and Slurm hosts. `ray_cluster.py` makes the reservation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.controller.direct_join import direct_target, join_direct
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.package import PACKAGE_PARENT
from monarch_kernel.wire.link_crypto import DOWN, Opener, Sealer
from monarch_kernel.wire.pinned_auth import PinnedJoin, PinnedKeyRefused, parse_public
from monarch_kernel.wire.ray_messages import AgentLaunch, AgentStarted
from monarch_kernel.wire.relay_link import RelayLink

START_TIMEOUT_S = 180.0  # the slot's call: python's start and the agent's imports on a busy node
ASK_TIMEOUT_S = 10.0  # a question to a slot (its agent's status, its log)


@dataclass
class RayNode:
    """A node of a Ray mesh: Ray's node id, its address and host name, its slots (one per rank, first
    one starts the agent) and the GPUs they hold, in rank order."""

    node_id: str
    address: str
    hostname: str
    slots: list[Any]  # Ray actor handles (RankSlot)
    gpu_ids: tuple[str, ...]
    python: str  # the interpreter the node's Ray workers run (the agent's, unless the mesh names one)


def _ray() -> Any:
    import ray

    return ray


class RayAgent:
    """The controller's hold on one node's agent (an `AgentHandle`)."""

    scheduled = True  # Ray can say whether the node is alive when the link goes

    def __init__(self, node: RayNode, join: PinnedJoin, started: AgentStarted, env: dict[str, str], log_path: str):
        self.node, self._join, self.env, self.log_path = node, join, env, log_path
        self.offer, self.pid = started.offer, started.pid
        self._closed = False

    @classmethod
    async def start(cls, node: RayNode, *, name: str, python: str | None, env: dict[str, str],
                    log_path: str) -> RayAgent:
        """Start the node's agent from its first slot and take its offer (MeshStartError with the reason)."""
        ray = _ray()
        join = PinnedJoin()
        launch = AgentLaunch(name, join.public_hex, node.address, python, PACKAGE_PARENT)
        try:
            started = await asyncio.to_thread(ray.get, node.slots[0].start_agent.remote(launch),
                                              timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise MeshStartError(f"the agent on Ray node {node.hostname} ({node.address}) did not start within "
                                 f"{START_TIMEOUT_S:.0f} s") from None
        except ray.exceptions.RayError as exc:
            raise MeshStartError(f"the agent on Ray node {node.hostname} ({node.address}) did not start: "
                                 f"{_cause(exc)}") from None
        return cls(node, join, started, env, log_path)

    async def attach(self, on_message: Callable[[Any], None],
                     on_close: Callable[[Exception | None], None]) -> RelayLink:
        """The encrypted link to the agent, on the address it offered."""
        said = self.offer.split()
        where = f"Ray node {self.node.hostname} ({self.node.address})"
        if said[:2] == ["link", "refused"]:
            raise MeshStartError(f"the agent on {where} cannot key its link: {' '.join(said[2:])}")
        if said[:1] == ["stdio"]:
            raise MeshStartError(f"the agent on {where} could not listen on {self.node.address} (see its log "
                                 "on the node): a Ray mesh needs a direct link to each node")
        if len(said) != 4 or said[0] != "direct":
            raise MeshStartError(f"the agent on {where} said {self.offer[:200]!r} where a link offer was due "
                                 "(another monarch_kernel version on the node?)")
        target = direct_target(said[1:3], self.node.address)
        if not isinstance(target, tuple):
            raise MeshStartError(f"{where}: {target or 'the agent offered no direct link'}")
        try:
            join, session = self._join.answer(parse_public(said[3]))
        except PinnedKeyRefused as exc:
            raise MeshStartError(f"the agent on {where} offered an unusable key ({exc})") from None
        seal_key, open_key = session.keys_for(DOWN)
        sealer, opener = Sealer(seal_key), Opener(open_key)
        first = join + b"".join(sealer.seal([json.dumps(self.env).encode()]))
        try:
            sock = await asyncio.to_thread(join_direct, target[0], target[1], first)
        except OSError as exc:
            raise MeshStartError(f"cannot reach the agent on {where} at {target[0]}:{target[1]} ({exc}): the "
                                 "notebook's machine must reach the Ray nodes' addresses") from None
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
        return RelayLink(reader, writer, (sealer, opener), DOWN, on_message, on_close)

    def _ask(self, method: str) -> Any:
        ray = _ray()
        return ray.get(getattr(self.node.slots[0], method).remote(), timeout=ASK_TIMEOUT_S)

    async def explain_exit(self) -> str:
        """Why the agent is gone: its exit status and the end of its log on the node."""
        try:
            status, tail = await asyncio.to_thread(lambda: (self._ask("agent_exit"), self._ask("log_tail")))
        except Exception as exc:  # noqa: BLE001 - the slot itself may be gone with its node
            return f"the agent on Ray node {self.node.hostname} is gone, and so is its slot ({_cause(exc)})"
        return (f"the agent on Ray node {self.node.hostname} ({self.node.address}) "
                f"{'still runs' if status is None else f'exited (status {status})'}" + (f":\n{tail}" if tail else ""))

    def job_ended(self) -> str:
        """A Ray reservation has no end of its own (it lasts while the kernel holds it)."""
        return ""

    def lost_reason(self) -> str:
        """What Ray says of the node when the link is lost ("" if Ray cannot say)."""
        try:
            nodes = _ray().nodes()
        except Exception:  # noqa: BLE001 - Ray itself unreachable: say nothing more
            return ""
        found = next((n for n in nodes if n.get("NodeID") == self.node.node_id), None)
        if found is None:
            return f"Ray no longer knows node {self.node.hostname} ({self.node.address})"
        if not found.get("Alive", True):
            return f"Ray says node {self.node.hostname} ({self.node.address}) is dead"
        return (f"Ray still counts node {self.node.hostname} ({self.node.address}) as alive: the node's network "
                "or its agent failed (Ray notices a dead node only after its health checks fail)")

    async def remove_shipped(self) -> None:
        """Nothing is shipped to Ray nodes (they run the cluster's own environment)."""

    async def wait_closed(self) -> None:
        """Until the agent has exited (or its slot is gone)."""
        while True:
            try:
                if await asyncio.to_thread(self._ask, "agent_exit") is not None:
                    return
            except Exception:  # noqa: BLE001 - the slot is gone: so is the agent (its stdin closed)
                return
            await asyncio.sleep(0.1)

    def close(self) -> None:
        """End the agent (its slot closes its stdin and signals it)."""
        if not self._closed:
            self._closed = True
            try:
                self.node.slots[0].stop_agent.remote(self.pid)
            except Exception:  # noqa: BLE001 - Ray gone: the slots (and agents) go with the job
                pass

    def let_go(self) -> None:
        """A persistent mesh is left (or taken over): the agent goes on in its detached slot, for the next kernel."""
        self._closed = True


def _cause(exc: BaseException) -> str:
    """The useful line of a Ray error (its cause's message, not Ray's framing)."""
    cause = getattr(exc, "cause", None)
    text = str(cause if cause is not None else exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
