"""The messages of persistent meshes: between a kernel and the agent of a mesh that outlives kernels.

The kernel that starts a mesh with `persist` sends `Persist` on its own link. Later kernels (and
`python -m monarch_kernel meshes`) reach the agent on its Unix socket, prove the mesh's secret
(`wire/direct_auth`), and send one request: `AttachRequest`, `MeshQuery` or `StopMesh`. The agent
answers a query with `MeshInfo`; an attach with its hello, then `Attached` (or `AttachRefused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monarch_kernel.wire.message_pickling import fast_pickling

ENDED_WITHOUT_KERNEL = 3  # an agent's exit status when its mesh ended with no kernel to release what held it
# (its persist time ran out, or `meshes stop`): a Ray slot then removes the mesh's placement group


@dataclass(frozen=True)
class Holder:
    """The kernel that holds a mesh: its pid, its notebook (if known) and since when (time.time())."""

    pid: int
    notebook: str
    since: float


@dataclass(frozen=True)
class Persist:
    """Kernel -> agent: outlive this kernel for `seconds` without one; listen at `socket` for the next
    ("": in a private folder of the agent's own, on an SSH host), which must prove `secret`. `record`: the
    path of the mesh's state file on this machine ("" on another), removed when the mesh ends."""

    seconds: float
    socket: str
    secret: bytes
    record: str
    holder: Holder


@dataclass(frozen=True)
class PersistReady:
    """Agent -> kernel: it listens at `socket`; once the record is written (`PersistRecorded`), the mesh
    outlives the kernel."""

    pid: int
    socket: str


@dataclass(frozen=True)
class PersistRecorded:
    """Kernel -> agent: the mesh's record is written (the next kernel can find it): from now on the end of this
    link is a detach. Until then it ends the mesh, which nobody could find."""


@dataclass(frozen=True)
class AttachRequest:
    """Kernel -> agent: become this mesh's controller (`take`: even if another kernel holds it)."""

    holder: Holder
    take: bool


@dataclass(frozen=True)
class AttachRefused:
    """Agent -> kernel: another live kernel holds the mesh."""

    holder: Holder


@dataclass(frozen=True)
class DetachedRank:
    """One rank as the agent knows it."""

    rank: int
    pid: int
    alive: bool
    activity: str  # what its actors run now ("Trainer.step 1.5s"), "" when idle
    fd_total: int  # bytes of its fd output passed on so far (wire/fd_marks.py)
    running: int | None = None  # the request it runs now (sent by an earlier kernel), if any
    running_label: str = ""  # ... and what it is called ("In[4]")


@dataclass(frozen=True)
class HeldBatch:
    """Agent -> kernel, just before `Attached`: part of what the ranks sent while no kernel was attached, in
    order (what was held goes in several frames, none near a frame's size limit)."""

    held: tuple[Any, ...]


@dataclass(frozen=True)
class Attached:
    """Agent -> kernel: you hold the mesh. `held`: the last of what the ranks sent while no kernel was attached
    (output, results, deaths), in order, after the `HeldBatch`es; `labels`: req_id -> what the request was
    ("In[4]")."""

    ranks: tuple[DetachedRank, ...]
    detached_for: float  # seconds without a kernel
    held: tuple[Any, ...]
    labels: dict[int, str]
    dropped_lines: int  # output lines beyond the bounds (lines and bytes per rank), dropped oldest first


@dataclass(frozen=True)
class TakenOver:
    """Agent -> the kernel that held the mesh: another kernel took it; this link closes."""

    holder: Holder


@dataclass(frozen=True)
class MeshQuery:
    """Listing: how is the mesh now?"""


@dataclass(frozen=True)
class MeshInfo:
    """The answer to a MeshQuery."""

    holder: Holder | None
    idle_for: float  # seconds without a kernel (0 while held)
    expires_in: float | None  # seconds left without a kernel (None while held)
    ranks: tuple[DetachedRank, ...]


@dataclass(frozen=True)
class StopMesh:
    """Stop the mesh now: every rank and the agent end, its record and folders go."""


fast_pickling(vars().values(), __name__)
