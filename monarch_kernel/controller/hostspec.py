"""What a host of a mesh is: this machine, an SSH target, a node of a Slurm allocation or of a Ray placement
group; and what a later
kernel holds of a persistent mesh's agent it reached itself."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class HostKind(enum.StrEnum):
    """How the controller reaches a host's agent."""

    LOCAL = "local"  # a child process of the notebook's kernel
    SSH = "ssh"  # started over SSH
    SLURM = "slurm"  # a job step on a node of a Slurm allocation
    RAY = "ray"  # started by a rank slot (a Ray actor) on a node of a Ray placement group
    WORKER = "worker"  # started by a worker that waits on an address (Monarch's run_worker_loop_forever)


@dataclass(frozen=True)
class HostSpec:
    """A host to run ranks on: this machine, an SSH target, a Slurm node (options: job, address) or a Ray node
    (options: node, address, env)."""

    name: str
    kind: HostKind = HostKind.LOCAL
    target: str | None = None  # ssh: host, user@host, host:port or user@host:port; slurm: the node
    python: str = "python3"  # the interpreter its agent runs with; on this machine, the kernel's own unless set
    setup: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    connect_timeout_s: float = 30.0
    ship_package: bool = False


DEFAULT_PYTHON = HostSpec.python  # what a host runs when nobody chose (a local host: the kernel's interpreter)


class ReachedAgentHandle:
    """What an `AgentHandle` is for the agent of a persistent mesh that a later kernel reached itself (over
    SSH, or on a Slurm node's port): no scheduler to ask, nothing shipped, and letting go is closing (the
    agent goes on either way). Subclasses say how to close and wait."""

    scheduled = False

    def job_ended(self) -> str:
        """Not asked: this kernel did not start the agent."""
        return ""

    def lost_reason(self) -> str:
        """Not asked."""
        return ""

    def attach(self, on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]) -> Any:
        """Not used: the attach makes the sealed link itself."""
        raise RuntimeError("a reached agent's link is made by the attach")

    async def remove_shipped(self) -> None:
        """Nothing: the agent removes its own copy of the package when it ends."""

    def close(self) -> None:
        """Close our connection (the agent goes on)."""

    def let_go(self) -> None:
        """As close."""
        self.close()
