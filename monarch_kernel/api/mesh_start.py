"""Checking a new mesh's settings and starting its runtime: what `local_mesh`, `ssh_mesh`,
`slurm_mesh` and `spawn_procs` share before there is a `Mesh` to hand out."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

from monarch_kernel.api.session import Session
from monarch_kernel.api.sinks import IdleOutput, report_timing
from monarch_kernel.controller.agent_reach import ask_now
from monarch_kernel.controller.hosts import HostKind, HostSpec
from monarch_kernel.controller.persistence import PersistentRuntime
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.controller.state import RELAY_BRANCHING, Allocation, MeshSpec
from monarch_kernel.core.addresses import is_unspecified
from monarch_kernel.core.errors import MeshInterrupted, MeshStartError, MeshUsageError
from monarch_kernel.core.mesh_records import RecordError, parse_duration, read_record, remove_record
from monarch_kernel.core.proc_bind import check_bindings
from monarch_kernel.wire.messages import HealthTimings
from monarch_kernel.wire.persist_messages import MeshQuery

BACKENDS = ("gloo", "nccl", "none")
MESH_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def start_runtime(hosts: list[HostSpec], gpus: int, dist: str, name: str | None, env: dict[str, str] | None,
                timeout: float, master_addr: str | None, health: HealthTimings | None, *,
                allocation: Allocation | None = None, preload: Sequence[str] | None = None,
                relay_branching: int = RELAY_BRANCHING, persist: str | float | None = None,
                proc_bind: Sequence[dict[str, str]] | None = None,
                rank_env: Sequence[dict[str, str]] | None = None) -> MeshRuntime:
    """Check a mesh's settings and start its runtime (agents and ranks); raises MeshUsageError or
    MeshStartError saying what to change. `Mesh.started` wraps it for the user."""
    if not isinstance(gpus, int) or gpus < 1:
        raise MeshUsageError(f"gpus={gpus!r}: give a positive number of ranks per host, e.g. gpus=4")
    if dist not in BACKENDS:
        raise MeshUsageError(f"dist={dist!r}: expected one of {', '.join(BACKENDS)}")
    name = name or f"mesh{next(Session.current().mesh_numbers)}"
    bad_keys = [k for k in [*(env or {}), *(k for each in rank_env or () for k in each)] if not _ENV_KEY.fullmatch(k)]
    if bad_keys:
        raise MeshUsageError(f"env keys {bad_keys!r} are not variable names (letters, digits and '_', "
                             "not starting with a digit)")
    if not MESH_NAME.fullmatch(name):
        raise MeshUsageError(f"mesh name {name!r}: use 1 to 64 letters, digits, '_', '-' or '.' "
                             "(it names private folders and sockets, so no '/' or spaces)")
    if master_addr is not None and is_unspecified(master_addr):
        raise MeshUsageError(f"master_addr={master_addr!r} names no host: give the address at which the "
                             "other hosts reach the first one (never 0.0.0.0 or an empty one)")
    if not isinstance(relay_branching, int) or relay_branching < 1:
        raise MeshUsageError(f"relay_branching={relay_branching!r}: give the number of hosts a relay sends to (>= 1)")
    persist_s = check_persist(persist, name, hosts) if persist is not None else None
    try:
        bindings = check_bindings(proc_bind, gpus) if proc_bind is not None else ()
    except ValueError as exc:
        raise MeshUsageError(str(exc)) from None
    if rank_env is not None and len(rank_env) != len(hosts) * gpus:
        raise MeshUsageError(f"rank_env: {len(rank_env)} entries for {len(hosts) * gpus} ranks; give one dict per rank")
    spec = MeshSpec(name, tuple(hosts), gpus, dist, dict(env or {}), master_addr, timeout, health or HealthTimings(),
                    preload=preload_list(preload, dist), allocation=allocation, relay_branching=relay_branching,
                    persist_s=persist_s, proc_bind=bindings,
                    rank_env=tuple(tuple(sorted(each.items())) for each in rank_env or ()))
    kind = MeshRuntime if persist_s is None else PersistentRuntime
    runtime = kind(spec, idle_output=IdleOutput(label=f"mesh {name!r}"), report_timing=report_timing)
    try:
        runtime.start()
    except BaseException as exc:
        runtime.shutdown()
        if isinstance(exc, MeshStartError):
            raise
        if isinstance(exc, KeyboardInterrupt):
            raise MeshInterrupted(f"starting mesh {name!r} was interrupted; nothing of it is left running",
                                  []) from None
        raise MeshStartError(f"mesh {name!r} failed to start: {exc}") from exc
    return runtime


SECRET_OPTIONS = frozenset({"password", "passphrase"})  # asyncssh options that hold a secret itself


def check_persist(persist: str | float, name: str, hosts: list[HostSpec]) -> float:
    """The seconds a new mesh persists; raises MeshUsageError saying what to change."""
    try:
        seconds = parse_duration(persist)
    except ValueError as exc:
        raise MeshUsageError(str(exc)) from None
    if any(h.kind == HostKind.WORKER for h in hosts):
        raise MeshUsageError("persist is for meshes this kernel starts (local, SSH, Slurm, Ray); workers of "
                             "attach_to_workers already outlive their clients: attach to them again")
    if any(h.kind == HostKind.SLURM and not h.options.get("direct", True) for h in hosts):
        raise MeshUsageError("persist on Slurm needs the direct link to the nodes (the next kernel reaches the agents "
                             "there): start without direct=False (--no-direct)")
    secrets = sorted({key for h in hosts for key in h.options if key in SECRET_OPTIONS})
    if secrets:
        raise MeshUsageError(f"persist keeps the SSH connect options in the mesh's record (a file on this machine) for "
                             f"the next kernel, and {', '.join(secrets)} would be stored there: use a key file "
                             "(client_keys=...) or your SSH agent instead")
    try:
        json.dumps([h.options for h in hosts if h.kind == HostKind.SSH])  # (the options a record keeps whole)
    except (TypeError, ValueError):
        raise MeshUsageError("persist keeps the SSH connect options in the mesh's record for the next kernel: give "
                             "them as paths, names and numbers (not objects)") from None
    try:
        record = read_record(name)
    except RecordError:
        return seconds  # none by that name (an unreadable one is replaced when the new one is written)
    if ask_now(record, MeshQuery()) is not None:
        raise MeshUsageError(f"a persistent mesh named {name!r} is running: attach it with %mesh attach {name} "
                             f"(monarch_kernel.attach({name!r})), or pick another name")
    remove_record(name, record.agent_pid)  # its agent is gone: the record is stale
    return seconds


def preload_list(preload: Sequence[str] | None, dist: str) -> tuple[str, ...]:
    """What each agent imports before forking: as asked, else torch when there is a process group."""
    if preload is None:
        return () if dist == "none" else ("torch",)
    if isinstance(preload, str):
        preload = [part for part in preload.split(",") if part.strip()]
    names = tuple(part.strip() for part in preload)
    bad = [n for n in names if not _MODULE.fullmatch(n)]
    if bad:
        raise MeshUsageError(f"preload={bad!r}: give module names (e.g. preload=['torch', 'transformers'])")
    return names


def cuda_count() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES first; 0 without torch)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0
