"""Hosts whose workers wait for us (Monarch's `attach_to_workers`): a HostMesh over them.

>>> hosts = attach_to_workers(ca="trust_all_connections", workers=["tcp://node7:4444", "tcp://node8:4444"])
>>> procs = hosts.spawn_procs(per_host={"gpus": 8})

Each worker runs `run_worker_loop_forever(address=...)` (agent/worker.py). `spawn_procs` starts a
mesh on them as on any hosts (an agent per host, started by its worker; see controller/worker_hosts.py
for how we are admitted), and `shutdown()` ends those processes; the workers go on waiting.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time
from collections.abc import Sequence

from monarch_kernel.actors.procs import HostMesh
from monarch_kernel.api.this_host import start_on_hosts
from monarch_kernel.controller.hostspec import HostKind, HostSpec
from monarch_kernel.controller.worker_hosts import end_worker
from monarch_kernel.core.errors import MeshStartError, MeshUsageError
from monarch_kernel.core.future import Future
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.worker_addresses import (
    WORKER_START_WAIT_S,
    WorkerAddress,
    WorkerAddressError,
    dial_address,
    not_answering,
)

PROBE_TIMEOUT_S = 10.0
END_TIMEOUT_S = 30.0  # how long shutdown() waits for the workers to take their end


def attach_to_workers(workers: Sequence[str | Future[str]], name: str | None = None) -> HostMesh:
    """A HostMesh {hosts: len(workers)} over these workers' addresses (strings, or futures of them)."""
    if isinstance(workers, str) or not workers:
        raise MeshUsageError("attach_to_workers(workers=[...]): give a list of worker addresses, e.g. "
                             "['tcp://node7:4444', 'ipc:///tmp/worker0']")
    addresses = [w.get() if isinstance(w, Future) else w for w in workers]
    for address in addresses:
        try:
            dial_address(address)
        except WorkerAddressError as exc:
            raise MeshUsageError(str(exc)) from None
    label = name or "workers"
    hosts = [HostSpec(f"{label}-{i}", HostKind.WORKER, options={"address": address})
             for i, address in enumerate(addresses)]
    return HostMesh(hosts, Shape((("hosts", len(hosts)),), tuple(range(len(hosts)))), start_on_hosts,
                    check=lambda: _probe(addresses), release=lambda: _end(addresses))


def _end(addresses: list[str]) -> None:
    """End the workers (HostMesh.shutdown, as Monarch's: the hosts take no more clients), on a thread of its own
    (the caller may be inside a running event loop)."""
    done = threading.Thread(target=lambda: asyncio.run(_end_all(addresses)), name="monarch-end-workers")
    done.start()
    done.join(END_TIMEOUT_S)


async def _end_all(addresses: list[str]) -> None:
    await asyncio.gather(*(end_worker(address) for address in addresses))


def _probe(addresses: list[str]) -> None:
    """Raise MeshStartError naming the first worker that is not there (a Unix socket that is no socket of
    ours, or a port that takes no connection)."""
    for text in addresses:
        address = dial_address(text)
        deadline = time.monotonic() + WORKER_START_WAIT_S
        while True:
            try:
                _look_at(address)
                break
            except (ConnectionRefusedError, FileNotFoundError) as exc:  # (it may be starting)
                if time.monotonic() > deadline:
                    raise MeshStartError(not_answering(address, str(exc))) from None
                time.sleep(0.1)
            except OSError as exc:
                raise MeshStartError(not_answering(address, str(exc))) from None


def _look_at(address: WorkerAddress) -> None:
    if address.path is not None:
        info = os.stat(address.path)
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
            raise OSError(f"{address.path} is not a socket of yours")
    else:
        socket.create_connection((address.host, address.port), timeout=PROBE_TIMEOUT_S).close()


