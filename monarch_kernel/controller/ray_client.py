"""The kernel's Ray client: `ray` imported, connected to a cluster, and dropped when a connect failed.

Ray's client keeps state that one interrupted or failed `ray.init` can spoil for every later one in
the process (the kernel's whole life), so every connect of ours goes through here:
- the imports a connect needs happen whole, before it, shielded from Ctrl-C (`import_ray`);
- a client left behind by a lost connection, a failed connect or an interrupted one is taken off Ray's
  context before the next connect (`connect`, `_drop_client`): Ray counts it as connected and would
  refuse every later `ray.init` with "ray client is already connected";
- Ray's own clean-up of a failed connect waits for the head's log stream without a bound (up to about
  160 s when the head failed to start this client's server: the head retries its channel 5 times,
  30 s each); while our `ray.init` runs that wait is bounded (`_bounded_log_stream_close`), and the
  log stream's thread (a daemon) ends on its own when the head lets it go.

`ray` is imported here and in `ray_cluster.py` only (an optional extra: `pip install monarch-kernel[ray]`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from monarch_kernel.core.errors import MeshStartError, MeshUsageError
from monarch_kernel.core.interrupt_shield import shielded

NAMESPACE = "monarch_kernel"  # our Ray namespace: the detached groups and slots of persistent meshes
LOG_STREAM_JOIN_S = 2.0  # how long Ray's clean-up of a failed connect waits for its log stream (see above)

# what a connect imports (`ray.init` imports its client's modules as it first connects): imported whole, before it
CLIENT_MODULES = ("ray", "grpc", "ray.client_builder", "ray.util.client.worker", "ray._private.grpc_utils",
                  "ray._private.runtime_env.uv_runtime_env_hook", "ray.util.client.runtime_context")


def import_ray() -> Any:
    """The `ray` module with its client's modules, or MeshUsageError saying how to install it.

    The imports are shielded from Ctrl-C (it is raised once they are done): an import cut short leaves a module
    half made, and a stop that landed in gRPC's import (which `ray.init` does as it first connects) once aborted
    the whole process ("Fatal Python error: Aborted"): the kernel, with every mesh it held."""
    def import_all() -> Any:
        for name in CLIENT_MODULES:
            importlib.import_module(name)
        return sys.modules["ray"]

    try:
        return shielded(import_all)
    except ImportError:
        raise MeshUsageError("Ray meshes need Ray: pip install 'monarch-kernel[ray]' (or ray[client]) in the "
                             "kernel's environment and on the cluster's nodes") from None


SERVER_START_TRIES = 2  # the head starts a server process per client; one that exits at start is tried again
# how a failed start of that server reaches the client: said so, or the head's own error as it looked at the dying
# process ("Initialization failure from server: ... psutil.ZombieProcess", seen on a loaded head)
SERVER_START_FAILED = ("Starting Ray client server failed", "Initialization failure from server")


def connect(address: str | None) -> Any:
    """Ray, connected (ray.init) unless this process already is; MeshStartError if the cluster cannot be reached.

    A client left behind by a lost connection (Ray gives up after its reconnect grace) or by a connect
    that was interrupted is dropped first: Ray would otherwise refuse every later `ray.init` with
    "ray client is already connected"."""
    ray = import_ray()
    if ray.is_initialized() and not client_lost():
        return ray
    _drop_client(ray)
    said = ""
    for _ in range(SERVER_START_TRIES):
        try:
            with _bounded_log_stream_close():
                ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR",
                         configure_logging=False)
            return ray
        except BaseException as exc:  # noqa: BLE001 - Ray raises many kinds here; an interrupt leaves a half client
            _drop_client(ray, failed=True)
            if not isinstance(exc, Exception):
                raise
            text = str(exc).strip()
            said = text.split(". ")[0].splitlines()[-1] if text else type(exc).__name__
            if not any(sign in text for sign in SERVER_START_FAILED):
                raise MeshStartError(
                    f"cannot connect to the Ray cluster at {address or 'auto'}: {said}. Check the address "
                    "(ray://HEAD:10001 for a Ray client) and, if the cluster uses token authentication, that "
                    "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH was set in the kernel's environment before Ray was "
                    "first imported") from None
            said = text.splitlines()[-1]  # (the head's own traceback: its last line says what failed)
    raise MeshStartError(f"the Ray head at {address} could not start its server for this client ({SERVER_START_TRIES} "
                         f"tries; the last said: {said}): see ray_client_server_*.err in the head's Ray logs "
                         "(/tmp/ray/session_latest/logs by default), then try again")


def client_lost() -> bool:
    """Whether this process holds a Ray client whose connection is gone (Ray still counts it as initialized
    when its data channel ended with an error it does not retry)."""
    try:
        from ray.util.client import ray as client
    except ImportError:
        return False
    worker = client.get_context().client_worker
    return worker is not None and (not worker.is_connected() or bool(getattr(worker.data_client, "_in_shutdown", False)))


def _drop_client(ray: Any, failed: bool = False) -> None:
    """Forget a Ray client that is not connected (a no-op when there is none); `failed`: the `ray.init` that made it
    failed or was interrupted, so whatever client it left is dropped, connected or not.

    Ray counts a client whose connect was cut short as connected, and refuses every later `ray.init` ("ray client
    is already connected"); its own disconnect does not reach such a client (it was never registered), and closing
    one whose server failed to start waits for the head's log stream, up to minutes. So the client is taken off
    its context here and closed, its channel first (`_close_quietly`)."""
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - a client whose channel is gone may fail to close it; it is dropped anyway
        pass
    try:
        from ray.util.client import ray as client
        from ray.util.client.api import _ClientAPI
    except ImportError:
        return
    context = client.get_context()
    worker = context.client_worker
    if worker is None or not (failed or client_lost()):
        return
    context.client_worker, context.api = None, _ClientAPI()
    client.disconnect()  # (Ray's bookkeeping of the contexts; the client itself is closed below)
    _close_quietly(worker)


def _close_quietly(worker: Any) -> None:
    """Close a dropped client: its channel first, which cancels its data and log streams at once, then the rest of
    Ray's close (which otherwise waits on those streams, up to minutes). No thread of it stays inside gRPC: one
    there makes gRPC's fork handlers crash the children this process forks (an agent, srun) with SIGSEGV."""
    worker._in_shutdown = True
    with contextlib.suppress(Exception):  # (its channel may be gone already)
        if worker.channel is not None:
            worker.channel.close()
    with contextlib.suppress(Exception):
        worker.close()


@contextlib.contextmanager
def _bounded_log_stream_close() -> Iterator[None]:
    """While entered, Ray's client waits at most LOG_STREAM_JOIN_S for its log stream's thread as it closes
    (Ray's own waits without a bound: see the module's note). Restored on leaving."""
    from ray.util.client.logsclient import LogstreamClient

    unbounded = LogstreamClient.close

    def close(self: Any) -> None:
        self.request_queue.put(None)
        if self.log_thread is not None:
            self.log_thread.join(LOG_STREAM_JOIN_S)

    LogstreamClient.close = close  # type: ignore[method-assign]
    try:
        yield
    finally:
        LogstreamClient.close = unbounded  # type: ignore[method-assign]
