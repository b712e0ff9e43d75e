"""monarch-kernel: a Jupyter-first, single-controller distributed kernel for PyTorch.

>>> import monarch_kernel
>>> mesh = monarch_kernel.local_mesh(gpus=4, dist="gloo")
>>> mesh.run("import torch.distributed as dist; dist.get_rank()")

In IPython/Jupyter: `%load_ext monarch_kernel`, then `%mesh up local --gpus 4` and `%%mesh`.
"""

from .actors import Actor, ActorDiedError, ActorError, ActorFailureEvent, ActorFuture, ActorMesh, current_rank, endpoint
from .errors import (
    CellSyntaxError,
    MeshError,
    MeshInterrupted,
    MeshNotRunningError,
    MeshStartError,
    MeshTimeoutError,
    MeshUsageError,
    RankDiedError,
    RankFailure,
    RemoteError,
    SerializationError,
)
from .futures import MeshFuture
from .mesh import Mesh, local_mesh, ssh_mesh
from .shape import Point, Shape
from .shardview import visualize_sharding
from .values import ValueMesh

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorDiedError",
    "ActorError",
    "ActorFailureEvent",
    "ActorFuture",
    "ActorMesh",
    "CellSyntaxError",
    "Mesh",
    "MeshError",
    "MeshFuture",
    "MeshInterrupted",
    "MeshNotRunningError",
    "MeshStartError",
    "MeshTimeoutError",
    "MeshUsageError",
    "Point",
    "RankDiedError",
    "RankFailure",
    "RemoteError",
    "SerializationError",
    "Shape",
    "ValueMesh",
    "current_rank",
    "endpoint",
    "load_ipython_extension",
    "local_mesh",
    "ssh_mesh",
    "unload_ipython_extension",
    "visualize_sharding",
]


def load_ipython_extension(ipython) -> None:
    """`%load_ext monarch_kernel`: register the %mesh magics and the live output view."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:
    """`%unload_ext monarch_kernel`: shut down meshes started from magics."""
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where JupyterLab's `labextension develop` finds the built Meshes sidebar."""
    return [{"src": "labextension", "dest": "monarch-kernel-meshes"}]
