"""Starting meshes on this machine and on SSH hosts (`slurm_mesh` is in api/slurm.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.mesh_start import cuda_count, start_runtime
from monarch_kernel.controller.hosts import HostKind, HostSpec
from monarch_kernel.controller.state import RELAY_BRANCHING
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.wire.messages import HealthTimings


def local_mesh(gpus: int | None = None, *, dist: str = "gloo", name: str | None = None,
               env: dict[str, str] | None = None, timeout: float = 120.0,
               health: HealthTimings | None = None, preload: Sequence[str] | None = None,
               persist: str | float | None = None, python: str | None = None,
               proc_bind: Sequence[dict[str, str]] | None = None,
               rank_env: Sequence[dict[str, str]] | None = None) -> Mesh:
    """Start `gpus` ranks on this machine, shape {hosts: 1, gpus: N}.

    `gpus` defaults to the number of CUDA devices (or 2 without any). `dist` is the
    torch.distributed backend: "gloo", "nccl" or "none". `health` sets how soon silent
    ranks and hosts count as failed (the defaults suit most uses). `preload` names modules
    each host imports once before forking its ranks (default: torch, unless dist="none").
    `persist` ("8h", "30m", seconds): the mesh outlives the kernel, ranks and all, that long without
    one; a later kernel takes it back with `monarch_kernel.attach(name)` (name it, then). `python`: the
    interpreter (or a wrapper script that execs one) the host's agent and ranks run with; the kernel's own
    by default. `proc_bind`: one dict per rank pinning it to CPUs or NUMA nodes, as Monarch's spawn_procs
    takes it (`[{"cpus": "0-3"}, {"cpus": "4-7"}]`; keys cpus, cpunodebind, physcpubind, membind). `rank_env`:
    one dict per rank of environment variables set in that rank over `env` (`[{"CUDA_VISIBLE_DEVICES": "0"}, ...]`).
    """
    if gpus is None:
        gpus = cuda_count() or 2
    host = HostSpec("localhost") if python is None else HostSpec("localhost", python=python)
    return Mesh.started(start_runtime([host], gpus, dist, name, env, timeout, None, health,
                                      preload=preload, persist=persist, proc_bind=proc_bind,
                                      rank_env=rank_env))


def ssh_mesh(hosts: list[str], gpus: int, *, dist: str = "nccl", python: str = "python3",
             setup: str | None = None, env: dict[str, str] | None = None, name: str | None = None,
             connect_options: dict[str, Any] | None = None, connect_timeout: float = 30.0,
             master_addr: str | None = None, ship_package: bool = False, timeout: float = 180.0,
             health: HealthTimings | None = None, preload: Sequence[str] | None = None,
             relay_branching: int = RELAY_BRANCHING, persist: str | float | None = None) -> Mesh:
    """Start `gpus` ranks on each SSH host, shape {hosts: len(hosts), gpus: N}.

    Hosts are `host`, `user@host` or `user@host:port`, resolved through ~/.ssh/config;
    host keys must be in known_hosts. Every host is connected and started in parallel.
    `python` is the remote interpreter (monarch_kernel must be importable there, or
    pass ship_package=True to copy this package's source to a temporary folder);
    `setup` is a shell snippet run first (e.g. "source ~/env.sh"); `master_addr` is
    host 0's address as the other hosts reach it (default: the one we connected to).
    `preload`: as for `local_mesh`. Past `relay_branching` hosts, the controller sends broadcasts
    to that many hosts and their agents relay them to the others (authenticated links). `persist`: as
    for `local_mesh`; the agents stay on the hosts and a later kernel reaches them over new SSH connections.
    """
    if not hosts:
        raise MeshUsageError("ssh_mesh() needs at least one host, e.g. ssh_mesh(['gpu-a'], gpus=8)")
    specs = [HostSpec(h, HostKind.SSH, target=h, python=python, setup=setup, options=dict(connect_options or {}),
                      connect_timeout_s=connect_timeout, ship_package=ship_package)
             for h in hosts]
    return Mesh.started(start_runtime(specs, gpus, dist, name, env, timeout, master_addr, health, preload=preload,
                                      relay_branching=relay_branching, persist=persist))
