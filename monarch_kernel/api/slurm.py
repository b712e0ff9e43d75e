"""`slurm_mesh()`: a mesh on the nodes of a Slurm allocation, submitted here or attached to."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.mesh_start import MESH_NAME, start_runtime
from monarch_kernel.api.session import Session
from monarch_kernel.controller import slurm
from monarch_kernel.controller.state import RELAY_BRANCHING
from monarch_kernel.core.errors import MeshInterrupted, MeshUsageError
from monarch_kernel.wire.messages import HealthTimings


def slurm_mesh(nodes: int = 1, gpus: int = 1, *, partition: str | None = None, time: str | None = None,
               account: str | None = None, qos: str | None = None, constraint: str | None = None,
               sbatch_args: Sequence[str] = (), request_gpus: bool = True, job: str | int | None = None,
               reuse: bool = False,
               python: str | None = None, setup: str | None = None, dist: str = "nccl",
               env: dict[str, str] | None = None, name: str | None = None, keep: bool = False,
               wait_timeout: float | None = None, timeout: float = 180.0, master_addr: str | None = None,
               health: HealthTimings | None = None, direct: bool = True,
               preload: Sequence[str] | None = None, relay_branching: int = RELAY_BRANCHING,
               persist: str | float | None = None) -> Mesh:
    """Start `gpus` ranks on each of `nodes` nodes of a new Slurm allocation (or of job `job`).

    While the job is pending one line shows its state and Slurm's reason; Ctrl-C (the stop
    button) or `wait_timeout` cancels it, leaving nothing queued. `reuse=True` attaches to
    your newest running job made by a mesh of this name (kept with `keep=True`). Each node runs one host
    agent as a job step (srun); ranks see Slurm's variables and torchrun's. `down` ends an
    allocation made here, unless `keep`; an attached one is left running. `request_gpus=False`
    asks for no GPUs (CPU nodes: `gpus` is then only the number of ranks per node).
    Each agent offers a direct TCP link that only this kernel can join (it proves a secret
    sent on the step's stdin); `direct=False` keeps all traffic on srun's stdio (slower for data).
    `preload` and `relay_branching`: as for `local_mesh` and `ssh_mesh`. `persist`: as for `local_mesh`; the
    agent steps outlive the kernel (the job lasts while they do), and a later kernel joins them on the nodes.
    """
    reuse_name = name
    name = name or f"mesh{next(Session.current().mesh_numbers)}"
    if not MESH_NAME.fullmatch(name):
        raise MeshUsageError(f"mesh name {name!r}: use 1 to 64 letters, digits, '_', '-' or '.'")
    if not isinstance(nodes, int) or nodes < 1:
        raise MeshUsageError(f"nodes={nodes!r}: give a positive number of nodes")
    request = slurm.SlurmRequest(nodes=nodes, gpus=gpus, partition=partition, time=time, account=account, qos=qos,
                                 constraint=constraint, sbatch_args=tuple(sbatch_args), request_gpus=request_gpus,
                                 job=None if job is None else str(job), reuse=reuse, name=name, keep=keep,
                                 wait_timeout=wait_timeout)
    try:
        if request.job or request.reuse:
            allocation = slurm.attach(request, reuse_name)
            _show(f"attached to {slurm.describe(allocation)}\n")
        else:
            allocation = slurm.allocate(request, _show)
    except KeyboardInterrupt:
        raise MeshInterrupted(f"waiting for the Slurm allocation of mesh {name!r} was stopped; the request was "
                              "cancelled, nothing is queued", []) from None
    allocation.python, allocation.setup, allocation.direct = python or sys.executable, setup, direct
    try:
        return Mesh.started(start_runtime(list(allocation.host_specs()), gpus, dist, name, env, timeout, master_addr,
                                          health, allocation=allocation, preload=preload,
                                          relay_branching=relay_branching, persist=persist))
    except BaseException:
        allocation.release()  # a mesh that did not start leaves no allocation behind (unless keep)
        raise


def _show(text: str) -> None:
    """The waiting line: rewritten in place (`\\r`) until the job runs."""
    sys.stdout.write(text)
    sys.stdout.flush()
