"""What a host of a mesh is: this machine, an SSH target, or a node of a Slurm allocation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class HostKind(enum.StrEnum):
    """How the controller reaches a host's agent."""

    LOCAL = "local"  # a child process of the notebook's kernel
    SSH = "ssh"  # started over SSH
    SLURM = "slurm"  # a job step on a node of a Slurm allocation


@dataclass(frozen=True)
class HostSpec:
    """A host to run ranks on: this machine, an SSH target, or a Slurm node (options: job, address)."""

    name: str
    kind: HostKind = HostKind.LOCAL
    target: str | None = None  # ssh: host, user@host, host:port or user@host:port; slurm: the node
    python: str = "python3"
    setup: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    connect_timeout_s: float = 30.0
    ship_package: bool = False
