"""What the controller and a Ray mesh's rank slots (`agent/ray_slot.py`) pass through Ray: typed values only,
no secrets (Ray's channels may be readable on the cluster network: `wire/pinned_auth`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotPlace:
    """Where Ray put a slot: its node, the node's address, host name, this slot's GPUs, and the Python it runs."""

    node_id: str
    address: str
    hostname: str
    gpu_ids: tuple[str, ...]
    python: str


@dataclass(frozen=True)
class AgentLaunch:
    """How to start a node's agent: its host name, the controller's public key (hex), where to listen."""

    host: str
    controller_key: str
    address: str
    python: str | None = None  # None: the interpreter this Ray worker runs
    extra_path: str | None = None  # prepended to PYTHONPATH (the package's parent, when it is not installed)


@dataclass(frozen=True)
class AgentStarted:
    """A node's agent, started: its offer line (`direct IP PORT KEY`, `stdio KEY` or `link refused WHY`) and pid."""

    offer: str
    pid: int
