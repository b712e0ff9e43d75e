"""torch.distributed on the ranks: the torchrun environment and the process group.

The rendezvous store is out of other users' reach where the platform allows:
- one host: a FileStore in a 0700 folder (the mesh's private shared-memory folder, or a
  private temporary folder of the agent), so no socket listens for it at all;
- several hosts: rank 0 hosts a TCPStore on a socket its host agent bound to MASTER_ADDR
  (never to all interfaces); it accepts any peer that reaches that address (see the
  README's "Security" section for the multi-host case).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from monarch_kernel.core.addresses import is_unspecified
from monarch_kernel.rank import collectives, thread_stops, user_process_groups
from monarch_kernel.rank.after_import import when_imported
from monarch_kernel.wire.messages import DistConfig, RankSpec


@dataclass(frozen=True)
class StoreSpec:
    """Where a rank finds the rendezvous store."""

    port: int  # MASTER_PORT: the TCPStore's port, or a free port for torchrun-style code
    file: str | None = None  # a FileStore path in a private folder (single-host meshes)
    listen_fd: int | None = None  # rank 0's inherited listening socket (multi-host meshes)


def bind_store_socket(addr: str) -> socket.socket:
    """A listening socket for rank 0's TCPStore, bound to addr on a free port."""
    if is_unspecified(addr):
        raise OSError(f"refusing to listen on {addr!r}: that is every interface; give an address of this host")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def free_port(addr: str) -> int:
    """A port that is free on addr now (for MASTER_PORT where our store needs none)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("127.0.0.1" if family == socket.AF_INET else "::1", 0))
        return int(sock.getsockname()[1])


def rank_environment(spec: RankSpec, dist: DistConfig, master_port: int, node_rank: int) -> dict[str, str]:
    """The variables torchrun would set for this rank."""
    env = {
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(dist.world_size),
        "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": dist.master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": "monarch_kernel",
    }
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_towards(dist.master_addr)
        if iface:  # gloo binds its pair sockets on the interface that reaches rank 0's host
            env["GLOO_SOCKET_IFNAME"] = iface
    return env


def interface_towards(addr: str) -> str | None:
    """Name of the local network interface used to reach addr (lo for loopback)."""
    if addr in ("127.0.0.1", "localhost", "::1"):
        return "lo"
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, 9))  # UDP connect sends nothing; it only picks a route
            local = probe.getsockname()[0]
        return _interface_with_address(local)
    except OSError:
        return None


def _interface_with_address(address: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def limit_threads(local_world_size: int) -> None:
    """Share the CPU cores among a host's ranks (torchrun sets OMP_NUM_THREADS likewise)."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
        os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")  # not yet imported: torch reads OMP_NUM_THREADS when it is
    if torch is not None:
        torch.set_num_threads(threads)


def _select_device(spec: RankSpec) -> Any:
    """This rank's CUDA device (local rank N uses GPU N), made current; None on hosts without one."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > spec.local_rank:
        device = torch.device("cuda", spec.local_rank)
        torch.cuda.set_device(device)
        thread_stops.rank_device = device  # (current on the actors' own threads too)
        return device
    return None


def _without_group(spec: RankSpec, dist: DistConfig, timeout: timedelta) -> Any:
    """A rank of a mesh without a process group: its device, and init_process_group's advice."""
    torch = sys.modules["torch"]
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    device = _select_device(spec)
    user_process_groups.install("none", dist.world_size, spec.rank, None, timeout)
    return device


def init_process_group(spec: RankSpec, dist: DistConfig, where: StoreSpec) -> str:
    """Set the rank's device and initialize the default process group; returns a summary.

    Without a process group on a rank forked without torch, that waits for the user's first
    `import torch` (a mesh started with dist="none" and no preload starts light).
    """
    timeout = timedelta(seconds=dist.timeout_s)
    if dist.backend == "none" and "torch" not in sys.modules:
        when_imported("torch", lambda _torch: _without_group(spec, dist, timeout))
        return f"rank {spec.rank}: no process group (torch is set up when first imported)"
    if dist.backend == "none":
        device = _without_group(spec, dist, timeout)
        return f"rank {spec.rank}: no process group" + (f", device {device}" if device else "")
    import torch
    import torch.distributed as tdist

    device = _select_device(spec)
    if dist.backend == "nccl" and device is None:
        raise RuntimeError(
            f"--dist nccl needs a CUDA GPU for local rank {spec.local_rank}, but this host has "
            f"{torch.cuda.device_count()}; use --dist gloo on CPU-only hosts"
        )
    store: Any
    if where.file is not None:
        store = tdist.FileStore(where.file, dist.world_size)
        store.set_timeout(timeout)
    elif where.listen_fd is not None:
        store = tdist.TCPStore(dist.master_addr, where.port, dist.world_size, True, timeout,
                               wait_for_workers=False, master_listen_fd=where.listen_fd)
    else:
        store = tdist.TCPStore(dist.master_addr, where.port, dist.world_size, False, timeout)
    kwargs: dict[str, Any] = {}
    if dist.backend == "nccl":
        kwargs["device_id"] = device
    collectives.track_group_sockets()  # so that a stop can free a rank stuck in a gloo collective
    tdist.init_process_group(dist.backend, store=store, rank=spec.rank,
                             world_size=dist.world_size, timeout=timeout, **kwargs)
    # a script's own init_process_group is served by this group; after a destroy it makes a new one
    user_process_groups.install(dist.backend, dist.world_size, spec.rank, store, timeout)
    return f"rank {spec.rank}: {dist.backend} process group of {dist.world_size}" + (
        f", device {device}" if device else "")
