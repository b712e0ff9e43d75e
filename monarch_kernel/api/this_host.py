"""`this_host()` and `this_proc()` in the notebook, as a Monarch program expects them.

`this_host()` is the notebook's machine: `this_host().spawn_procs(per_host={"gpus": 4})`
starts a local mesh as `%mesh up local --gpus 4` does. `this_proc()` is, in Monarch, the
client's own process; here it is a one-rank local mesh started on first use, so that
actors spawned on it never block the notebook's kernel.
"""

from __future__ import annotations

from typing import Any

from monarch_kernel.actors.procs import HostMesh, ProcMesh, mesh_started, stop_actors_then_processes
from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.mesh_start import start_runtime
from monarch_kernel.api.session import Session
from monarch_kernel.api.starting import local_mesh
from monarch_kernel.controller.hostspec import DEFAULT_PYTHON, HostSpec
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.shape import Shape

THIS_PROC = "this_proc"  # the name of the mesh this_proc() starts
_started_here: list[Mesh] = []  # the meshes this_host().spawn_procs started (shutdown_context stops them)



# what spawn_procs on this machine takes
_LOCAL_OPTIONS = {"dist", "env", "preload", "timeout", "health", "proc_bind", "rank_env"}


def _check_options(options: dict[str, Any], where: str) -> None:
    if set(options) - _LOCAL_OPTIONS:
        raise MeshUsageError(f"spawn_procs() on {where} takes {', '.join(sorted(_LOCAL_OPTIONS))}; "
                             f"not {', '.join(sorted(set(options) - _LOCAL_OPTIONS))}")


def _start_local(hosts: tuple[HostSpec, ...], gpus: int, name: str | None, options: dict[str, Any]) -> Mesh:
    _check_options(options, "this host")
    python = hosts[0].python if hosts and hosts[0].python != DEFAULT_PYTHON else None
    return _started_here_by_the_api(local_mesh(gpus, name=name, python=python, **options))


def start_on_hosts(hosts: tuple[HostSpec, ...], gpus: int, name: str | None, options: dict[str, Any]) -> Mesh:
    """A new mesh of `gpus` ranks on each of these hosts (a job's, or workers'), with `options` (spawn_procs')."""
    _check_options(options, "these hosts")
    env = {**(hosts[0].options.get("env") or {}), **(options.get("env") or {})}
    mesh = Mesh.started(start_runtime(list(hosts), gpus, options.get("dist", "gloo"), name, env or None,
                                      options.get("timeout", 120.0), None, options.get("health"),
                                      preload=options.get("preload"), proc_bind=options.get("proc_bind"),
                                      rank_env=options.get("rank_env")))
    return _started_here_by_the_api(mesh)


def _started_here_by_the_api(mesh: Mesh) -> Mesh:
    """A mesh spawn_procs started: its lines tagged as Monarch's, and stopped by shutdown_context."""
    mesh.tag_lines_as_monarch()
    _started_here.append(mesh)
    return mesh


def local_hosts(count: int, label: str, env: dict[str, str] | None = None) -> HostMesh:
    """`count` hosts on this machine, shape {hosts: count}: each of them runs its own host agent (as a
    separate machine's would), and `spawn_procs` starts processes on every one (Monarch's ProcessJob)."""
    if not isinstance(count, int) or count < 1:
        raise MeshUsageError(f"{label}: {count!r} hosts; give a positive number")
    hosts = [HostSpec(f"{label}-{i}", options={"env": dict(env or {})}) for i in range(count)]
    return HostMesh(hosts, Shape((("hosts", count),), tuple(range(count))), start_on_hosts)


def this_host() -> HostMesh:
    """The notebook's machine, as a host mesh of one host (no dims)."""
    return HostMesh([HostSpec("localhost")], Shape((), (0,)), _start_local)


def this_proc() -> ProcMesh:
    """One process on this machine for actors (a one-rank local mesh), started on first use."""
    session = Session.current()
    with session.this_proc_lock:
        if session.this_proc is not None and not session.this_proc[1].closed:
            return session.this_proc[0]
        mesh = local_mesh(1, name=THIS_PROC, dist="none")
        mesh.tag_lines_as_monarch()
        for started in mesh_started:
            started(mesh)
        procs = ProcMesh(mesh.name, Shape((), mesh.ranks), stop=mesh.shutdown)
        session.this_proc = (procs, mesh)
        return procs


def stop_started_here() -> int:
    """Stop the processes that `this_host().spawn_procs` and `this_proc()` started; how many meshes were
    stopped. Meshes started with `%mesh up` are not touched, and a later spawn_procs starts new ones."""
    session = Session.current()
    with session.this_proc_lock:
        meshes = [mesh for mesh in _started_here if not mesh.closed]
        _started_here.clear()
        if session.this_proc is not None:
            meshes.append(session.this_proc[1])
            session.this_proc = None
    for mesh in meshes:
        stop_actors_then_processes(mesh)
    return len(meshes)
