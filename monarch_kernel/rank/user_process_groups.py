"""`init_process_group` as torchrun scripts call it, on a rank that already has a process group.

A script run under torchrun sets up its own group (`dist.init_process_group("gloo")`) and
usually ends with `dist.destroy_process_group()`. On a mesh the group already exists, and
the same script may run many times. So, on every rank:
- a call while the mesh's group is up, asking for what that group is (same backend, world
  size and rank, any rendezvous), is served by it: nothing happens, nothing fails;
- a call asking for something else fails at once and says what differs;
- after `destroy_process_group()`, a call with the default rendezvous (`env://`), or
  `init_device_mesh`, makes a new group through the mesh's own store (a FileStore in the
  private folder, or rank 0's TCPStore), under a fresh key prefix each time, so nothing
  needs a free port and no rank waits for a socket that nobody serves.
Calls with their own `store=` or `init_method=` after a destroy go to torch unchanged.
`destroy_process_group()` of a gloo default group first waits for every rank (a barrier):
without it a rank still finishing its last collective could wait forever on a peer that
had already torn its connections down (seen about once in ten runs of a DDP script); and the
destroyed groups stay referenced here until the next destroy (see `_retire`).
"""

from __future__ import annotations

import functools
import sys
from datetime import timedelta
from typing import Any

_state: dict[str, Any] = {"generation": 0}


def install(backend: str, world_size: int, rank: int, store: Any, timeout: timedelta) -> None:
    """Wrap torch.distributed's init_process_group on this rank (store: the mesh's, kept alive here).

    backend "none": the mesh has no store; a default-rendezvous call says how to get one.
    """
    from torch.distributed import distributed_c10d as c10d

    original = _state.setdefault("original", c10d.init_process_group)
    _state.update(backend=backend, world_size=world_size, rank=rank, store=store, timeout=timeout)

    @functools.wraps(original)
    def init_process_group(backend: str | None = None, init_method: str | None = None,
                           timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                           store: Any = None, group_name: str = "", pg_options: Any = None,
                           device_id: Any = None, **more: Any) -> None:
        if c10d.is_initialized():
            problem = _difference(backend, world_size, rank)
            if problem:
                raise ValueError(problem)
            return None  # the mesh's group serves the script, as if it had just made it
        if store is None and init_method in (None, "env://"):
            store, world_size, rank = _next_store(world_size, rank)
            timeout = timeout or _state["timeout"]
            backend = backend or (_state["backend"] if _state["backend"] != "none" else None)
        return original(backend, None if store is not None else init_method, timeout, world_size, rank, store,
                        group_name, pg_options, device_id, **more)

    init_process_group.__monarch_kernel__ = True  # type: ignore[attr-defined]
    _replace_everywhere(original, init_process_group)
    destroy = _state.setdefault("original_destroy", c10d.destroy_process_group)

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None and c10d.is_initialized() and c10d.get_backend() == "gloo":
            # gloo's work threads may still be finishing a rank's last collective when a faster
            # rank tears its connections down; that rank then waits forever. Under torchrun the
            # processes exit right after; on a mesh they live on, so every rank first meets here.
            c10d.barrier()
        _retire(list(c10d._world.pg_names) if group is None else [group])
        destroy(group)
        if group is None:
            from monarch_kernel.rank.collectives import forget_group_sockets

            forget_group_sockets()

    _replace_everywhere(destroy, destroy_process_group, "destroy_process_group")


def _retire(groups: list[Any]) -> None:
    """Hold the groups being destroyed until the next destroy, so that their last reference is ours.

    A DDP model's reducer holds its group too, and frees it with the GIL held when the model goes
    (at the end of a script's `main`). Freeing a gloo group joins its work threads; one of them may
    still be releasing the barrier's work, which needs the GIL: the rank then hangs for good (seen
    about once in a thousand DDP runs under load). Python's reference to a group frees it with the
    GIL released, so the group held here, dropped later, is freed safely whoever lets go first.
    """
    _state["retired"] = groups  # (the groups of the destroy before this one go now, long after their barrier)


def remake_default_group(key: str) -> list[str]:
    """A fresh default group (the mesh's backend, world and rank) through the mesh's store under `key`,
    after a stop broke the old groups on every rank; returns how the groups made in cells were named
    (they are gone). Every rank calls it with the same key."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    from monarch_kernel.rank.collectives import forget_group_sockets

    if _state.get("store") is None:
        raise RuntimeError("this mesh has no process group to make anew")
    gone = []
    if c10d.is_initialized():
        default = c10d._get_default_group()
        for pg in list(c10d._world.pg_names):
            if pg is not default:
                desc = str(getattr(pg, "group_desc", "") or "")
                ranks = ",".join(str(r) for r in tdist.get_process_group_ranks(pg))
                gone.append(f"{desc!r} (ranks {ranks})" if desc and desc != "undefined" else f"ranks {ranks}")
        _retire(list(c10d._world.pg_names))
        _state["original_destroy"](None)  # (not the wrapper: its barrier would wait on the broken group)
    forget_group_sockets()
    kwargs: dict[str, Any] = {}
    if _state["backend"] == "nccl":
        import torch

        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    _state["original"](_state["backend"], store=tdist.PrefixStore(f"monarch_kernel/{key}", _state["store"]),
                       rank=_state["rank"], world_size=_state["world_size"], timeout=_state["timeout"], **kwargs)
    return gone


def _difference(backend: str | None, world_size: int, rank: int) -> str | None:
    """Why a call cannot be served by the mesh's group (None: it can)."""
    ours = _state["backend"]
    wanted = None if backend is None else str(backend).lower()
    asked = []
    if wanted not in (None, ours) and ours not in [part.split(":")[-1] for part in (wanted or "").split(",")]:
        asked.append(f"backend {backend!r}")
    if world_size not in (-1, _state["world_size"]):
        asked.append(f"world_size={world_size}")
    if rank not in (-1, _state["rank"]):
        asked.append(f"rank={rank}")
    if not asked:
        return None
    return (f"init_process_group asks for {', '.join(asked)}, but this mesh's process group is {ours} with "
            f"world_size={_state['world_size']} and this is rank {_state['rank']}. Start the mesh with what "
            "the script needs (e.g. --dist nccl), or call dist.destroy_process_group() first to make your own.")


def _next_store(world_size: int, rank: int) -> tuple[Any, int, int]:
    import torch.distributed as tdist

    if _state["store"] is None:
        raise RuntimeError("this mesh was started without a process group (dist='none'), so it has no "
                           "rendezvous store; start it with --dist gloo or nccl, or pass init_method or store")
    _state["generation"] += 1  # every rank makes the same calls in the same order (SPMD)
    store = tdist.PrefixStore(f"monarch_kernel/{_state['generation']}", _state["store"])
    return (store, _state["world_size"] if world_size == -1 else world_size,
            _state["rank"] if rank == -1 else rank)


def _replace_everywhere(original: Any, wrapper: Any, attribute: str = "init_process_group") -> None:
    """Point every torch.distributed module that imported the function by name at the wrapper."""
    import torch.distributed.device_mesh  # noqa: F401 - it holds its own reference

    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, attribute, None) is original:
            setattr(module, attribute, wrapper)
