"""monarch-kernel: a Jupyter-first, single-controller distributed kernel for PyTorch.

>>> import monarch_kernel
>>> mesh = monarch_kernel.local_mesh(gpus=4, dist="gloo")
>>> mesh.run("import torch.distributed as dist; dist.get_rank()")

In IPython/Jupyter: `%load_ext monarch_kernel`, then `%mesh up local --gpus 4` and `%%mesh`.

The public names load lazily (PEP 562), so that a rank or a host agent, which import
this package too, never load the notebook-side modules (controller, API, views).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "__version__": "monarch_kernel.core.versions",  # (the one place it lives)
    "Actor": "monarch_kernel.actors.base",
    "current_rank": "monarch_kernel.actors.base",
    "endpoint": "monarch_kernel.actors.base",
    "ActorFailureEvent": "monarch_kernel.actors.client",
    "ActorFuture": "monarch_kernel.actors.client",
    "ActorMesh": "monarch_kernel.actors.client",
    "ActorDiedError": "monarch_kernel.core.errors",
    "ActorDeadlockError": "monarch_kernel.core.errors",
    "ActorError": "monarch_kernel.core.errors",
    "CellSyntaxError": "monarch_kernel.core.errors",
    "SupervisionError": "monarch_kernel.core.errors",
    "MeshError": "monarch_kernel.core.errors",
    "MeshInterrupted": "monarch_kernel.core.errors",
    "MeshNotRunningError": "monarch_kernel.core.errors",
    "MeshBusyError": "monarch_kernel.core.errors",
    "MeshStartError": "monarch_kernel.core.errors",
    "MeshTimeoutError": "monarch_kernel.core.errors",
    "MeshUsageError": "monarch_kernel.core.errors",
    "MonarchWarning": "monarch_kernel.core.errors",
    "RankDiedError": "monarch_kernel.core.errors",
    "RemoteError": "monarch_kernel.core.errors",
    "SerializationError": "monarch_kernel.core.errors",
    "RankFailure": "monarch_kernel.core.failures",
    "Point": "monarch_kernel.core.shape",
    "Shape": "monarch_kernel.core.shape",
    "ValueMesh": "monarch_kernel.core.values",
    "MeshFuture": "monarch_kernel.api.futures",
    "Mesh": "monarch_kernel.api.mesh",
    "local_mesh": "monarch_kernel.api.starting",
    "ssh_mesh": "monarch_kernel.api.starting",
    "slurm_mesh": "monarch_kernel.api.slurm",
    "ray_mesh": "monarch_kernel.api.ray",
    "attach": "monarch_kernel.api.persistent",
    "persistent_meshes": "monarch_kernel.api.persistent",
    "stop_persistent": "monarch_kernel.api.persistent",
    "plan": "monarch_kernel.api.planning",
    "Plan": "monarch_kernel.api.planning",
    "Candidate": "monarch_kernel.api.planning",
    "Accelerator": "monarch_kernel.planner.hardware",
    "visualize_sharding": "monarch_kernel.views.shardview",
    "HealthTimings": "monarch_kernel.wire.messages",
}

__all__ = [
    "Accelerator",
    "Actor",
    "ActorDiedError",
    "ActorDeadlockError",
    "ActorError",
    "ActorFailureEvent",
    "ActorFuture",
    "ActorMesh",
    "Candidate",
    "CellSyntaxError",
    "HealthTimings",
    "Mesh",
    "MeshError",
    "MeshFuture",
    "MeshInterrupted",
    "MeshNotRunningError",
    "MeshBusyError",
    "MeshStartError",
    "MeshTimeoutError",
    "MeshUsageError",
    "MonarchWarning",
    "Plan",
    "Point",
    "RankDiedError",
    "RankFailure",
    "RemoteError",
    "SerializationError",
    "SupervisionError",
    "Shape",
    "ValueMesh",
    "attach",
    "current_rank",
    "endpoint",
    "load_ipython_extension",
    "local_mesh",
    "persistent_meshes",
    "plan",
    "ray_mesh",
    "slurm_mesh",
    "ssh_mesh",
    "stop_persistent",
    "unload_ipython_extension",
    "visualize_sharding",
]

if TYPE_CHECKING:
    from monarch_kernel.actors.base import Actor, current_rank, endpoint
    from monarch_kernel.actors.client import ActorFailureEvent, ActorFuture, ActorMesh
    from monarch_kernel.api.futures import MeshFuture
    from monarch_kernel.api.mesh import Mesh
    from monarch_kernel.api.persistent import attach, persistent_meshes, stop_persistent
    from monarch_kernel.api.planning import Candidate, Plan, plan
    from monarch_kernel.api.starting import local_mesh, ssh_mesh
    from monarch_kernel.core.errors import (
        ActorDeadlockError,
        ActorDiedError,
        ActorError,
        CellSyntaxError,
        MeshBusyError,
        MeshError,
        MeshInterrupted,
        MeshNotRunningError,
        MeshStartError,
        MeshTimeoutError,
        MeshUsageError,
        RankDiedError,
        RemoteError,
        SerializationError,
        SupervisionError,
    )
    from monarch_kernel.core.failures import RankFailure
    from monarch_kernel.core.shape import Point, Shape
    from monarch_kernel.core.values import ValueMesh
    from monarch_kernel.core.versions import __version__ as __version__
    from monarch_kernel.planner.hardware import Accelerator
    from monarch_kernel.views.shardview import visualize_sharding
    from monarch_kernel.wire.messages import HealthTimings


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monarch_kernel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext monarch_kernel`: register the %mesh magics and the live output view."""
    from monarch_kernel.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext monarch_kernel`: shut down meshes started from magics."""
    from monarch_kernel.magics import unload_ipython_extension as _unload

    _unload(ipython)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where JupyterLab's `labextension develop` finds the built Meshes sidebar."""
    return [{"src": "labextension", "dest": "monarch-kernel-meshes"}]
