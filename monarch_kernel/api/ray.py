"""`ray_mesh()`: a mesh on the nodes of a Ray cluster, reserved as a placement group."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.mesh_start import MESH_NAME, start_runtime
from monarch_kernel.api.session import Session
from monarch_kernel.controller import ray_cluster
from monarch_kernel.controller.state import RELAY_BRANCHING
from monarch_kernel.core.errors import MeshInterrupted, MeshUsageError
from monarch_kernel.wire.messages import HealthTimings


def ray_mesh(address: str | None = None, hosts: int = 1, gpus: int = 1, *, strategy: str | None = None,
             gpus_per_rank: float = 1.0, request_gpus: bool = True, resources: Mapping[str, float] | None = None,
             python: str | None = None, dist: str = "nccl", env: dict[str, str] | None = None,
             name: str | None = None, wait_timeout: float | None = None, timeout: float = 180.0,
             master_addr: str | None = None, health: HealthTimings | None = None,
             preload: Sequence[str] | None = None, relay_branching: int = RELAY_BRANCHING,
             persist: str | float | None = None) -> Mesh:
    """Start `gpus` ranks on each of `hosts` nodes of a Ray cluster.

    `address`: "auto" (this machine is a node of the cluster), "ray://HEAD:10001" (a Ray client,
    e.g. from a laptop or a login node) or "HEAD:6379"; None uses the Ray this process is already
    connected to, else "auto". Token authentication is Ray's own: `RAY_AUTH_MODE=token` with
    `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` in the kernel's environment.

    The ranks are reserved as one placement group, a bundle per rank (`{"GPU": gpus_per_rank}` plus
    `resources`, e.g. `{"CPU": 8}`), placed with Ray's `strategy` (PACK, SPREAD, STRICT_PACK or
    STRICT_SPREAD; by default STRICT_PACK for one host, else PACK). While Ray places them one line
    shows the wait; Ctrl-C (the stop button) or `wait_timeout` removes the request. Each node then runs
    one host agent, started by a Ray actor in the node's first bundle and linked to this kernel
    directly (encrypted, keyed through Ray); ranks see the GPUs Ray assigned as CUDA_VISIBLE_DEVICES,
    and torchrun's variables. `request_gpus=False` asks for no GPUs (CPU nodes: `gpus` is then only
    the number of ranks per node). `down` removes the group; if the kernel dies, Ray removes it and
    the ranks stop. `persist` ("8h", "30m", seconds): the mesh outlives the kernel that long without
    one, its group and slots detached from the kernel's Ray job (`monarch_kernel.attach(name)` takes
    it back; when its time runs out, or `python -m monarch_kernel meshes stop NAME`, the group is
    removed). Other arguments: as for `ssh_mesh`.
    """
    name = name or f"mesh{next(Session.current().mesh_numbers)}"
    if not MESH_NAME.fullmatch(name):
        raise MeshUsageError(f"mesh name {name!r}: use 1 to 64 letters, digits, '_', '-' or '.'")
    placement = (strategy or ("STRICT_PACK" if hosts == 1 else "PACK")).upper()
    request = ray_cluster.RayRequest(address=address, hosts=hosts, gpus=gpus, gpus_per_rank=gpus_per_rank,
                                     request_gpus=request_gpus, resources=dict(resources or {}),
                                     strategy=placement, name=name, wait_timeout=wait_timeout, python=python,
                                     detached=persist is not None)
    try:
        reservation = ray_cluster.reserve(request, _show)
    except KeyboardInterrupt:
        raise MeshInterrupted(f"waiting for Ray to place mesh {name!r} was stopped; the request was removed, "
                              "nothing is left reserved", []) from None
    try:
        return Mesh.started(start_runtime(list(reservation.host_specs()), gpus, dist, name, env, timeout,
                                          master_addr, health, allocation=reservation, preload=preload,
                                          relay_branching=relay_branching, persist=persist))
    except BaseException:
        reservation.release()  # a mesh that did not start leaves nothing reserved
        raise


def _show(text: str) -> None:
    """The waiting line: rewritten in place (`\\r`) until Ray has placed the group."""
    sys.stdout.write(text)
    sys.stdout.flush()
