"""The kernel's Ray client: `ray` imported, connected to a cluster, and dropped when a connect failed.

Ray's client keeps state that one interrupted or failed `ray.init` can spoil for every later one in
the process (the kernel's whole life), so every connect of ours goes through here:
- the imports a connect needs happen whole, before it, shielded from Ctrl-C (`import_ray`);
- `ray.init` runs on a thread of its own, so a Ctrl-C never lands inside it: it ends the kernel's wait,
  and the connect goes on for the next `connect` to take over (`connect`, `_Connect`);
- a client left behind by a lost connection or a failed connect is taken off Ray's context before the
  next connect (`_drop_client`): Ray counts it as connected and would refuse every later `ray.init` with
  "ray client is already connected";
- Ray's own clean-up of a failed connect waits for the head to end the client's streams, without a bound:
  its data stream for the reconnect grace (30 s by default; the head holds a stream whose server failed to
  start that long), its log stream up to about 160 s (the head retries its channel 5 times, 30 s each).
  While our `ray.init` runs, that clean-up closes the client's channel first, which ends both streams at
  once (`_channel_first_close`); a head's failed server start then costs seconds, and is tried again.

`ray` is imported here and in `ray_cluster.py` only (an optional extra: `pip install monarch-kernel[ray]`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from monarch_kernel.core.errors import MeshStartError, MeshUsageError
from monarch_kernel.core.interrupt_shield import shielded

NAMESPACE = "monarch_kernel"  # our Ray namespace: the detached groups and slots of persistent meshes

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


# the head starts a server process per client, and a start that failed is tried again after these pauses: a busy
# head's proxy forks that process while its gRPC threads are at work, and the child then and again dies at once
# (gRPC's fork handlers; seen in bursts, several starts in a row, on a 2-core head beside interrupted connects)
SERVER_START_PAUSES_S = (0.5, 2.0, 5.0)
# how a failed start of that server reaches the client: said so, or the head's own error as it looked at the dying
# process ("Initialization failure from server: ... psutil.ZombieProcess", seen on a loaded head)
SERVER_START_FAILED = ("Starting Ray client server failed", "Initialization failure from server")


def connect(address: str | None) -> Any:
    """Ray, connected (ray.init) unless this process already is; MeshStartError if the cluster cannot be reached.

    The connect runs on a thread of its own and this waits for it: Ctrl-C ends the wait at once, never Ray's
    connect itself. A stop that landed inside `ray.init` left a gRPC call that nobody would finish, and closing
    that client's channel then waited for it forever (seen: the kernel hung in the next connect). A connect that
    was stopped goes on, and the next `connect` takes it over: waits for it, and uses what it made.

    A client left behind by a lost connection (Ray gives up after its reconnect grace) or by a failed connect
    is dropped first: Ray would otherwise refuse every later `ray.init` with "ray client is already connected"."""
    ray = import_ray()
    global _connecting
    while True:
        with _connecting_lock:
            if _connecting is None:
                if ray.is_initialized() and not client_lost():
                    return ray
                _connecting = mine = _Connect(ray, address)
            else:
                mine = None  # (one that a stop left: waited for, then this goes round again)
            attempt = _connecting
        attempt.done.wait()  # (bounded by Ray's own connect timeouts; Ctrl-C ends it at once)
        with _connecting_lock:
            if _connecting is attempt:
                _connecting = None
        if attempt is mine and attempt.error is not None:
            raise attempt.error


class _Connect:
    """One connect to the cluster at `address`, on a thread of its own; `done` is set when it ended, with `error`
    None (connected) or what it raised."""

    def __init__(self, ray: Any, address: str | None) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(ray, address), name="monarch-ray-connect", daemon=True).start()

    def _run(self, ray: Any, address: str | None) -> None:
        _not_on_the_main_thread_is_meant()
        try:
            _connect_now(ray, address)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            self.error = exc
        finally:
            self.done.set()


def _not_on_the_main_thread_is_meant() -> None:
    """Keep quiet Ray's warning that `ray.init` off the main thread leaves SIGTERM's handler alone: that is what we
    want (on the main thread Ray puts its own in place of the kernel's, one that exits the process)."""
    worker_log = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _SigtermNotSetFilter) for f in worker_log.filters):
        worker_log.addFilter(_SigtermNotSetFilter())


class _SigtermNotSetFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")


_connecting: _Connect | None = None  # the connect under way, if any (`connect`)
_connecting_lock = threading.Lock()


def _connect_now(ray: Any, address: str | None) -> None:
    """`ray.init` on this thread, after dropping a client that is lost; a server start that failed on the head is
    tried again after SERVER_START_PAUSES_S."""
    _drop_client(ray)
    said = ""
    for pause in (*SERVER_START_PAUSES_S, None):
        try:
            with _channel_first_close():
                ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR",
                         configure_logging=False)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here
            _drop_client(ray, failed=True)
            text = str(exc).strip()
            said = text.split(". ")[0].splitlines()[-1] if text else type(exc).__name__
            if not any(sign in text for sign in SERVER_START_FAILED):
                raise MeshStartError(
                    f"cannot connect to the Ray cluster at {address or 'auto'}: {said}. Check the address "
                    "(ray://HEAD:10001 for a Ray client) and, if the cluster uses token authentication, that "
                    "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH was set in the kernel's environment before Ray was "
                    "first imported") from None
            said = text.splitlines()[-1]  # (the head's own traceback: its last line says what failed)
            if pause is not None:
                time.sleep(pause)
    raise MeshStartError(f"the Ray head at {address} could not start its server for this client "
                         f"({len(SERVER_START_PAUSES_S) + 1} tries; the last said: {said}): see "
                         "ray_client_server_*.err in the head's Ray logs (/tmp/ray/session_latest/logs by default), "
                         "then try again")


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
    _close_channel(worker)
    with contextlib.suppress(Exception):
        worker.close()


def _close_channel(worker: Any) -> None:
    """End a client's gRPC channel, and with it every stream on it, its data and log streams among them."""
    worker._in_shutdown = True
    with contextlib.suppress(Exception):  # (its channel may be gone already)
        if worker.channel is not None:
            worker.channel.close()


@contextlib.contextmanager
def _channel_first_close() -> Iterator[None]:
    """While entered, Ray's client closes as `_close_quietly` does: its channel first, so that its data and log
    streams end at once, not when the head lets them go (Ray's own close waits for both without a bound: see the
    module's note). Restored on leaving."""
    from ray.util.client.worker import Worker

    unbounded = Worker.close

    def close(self: Any) -> None:
        _close_channel(self)
        unbounded(self)

    Worker.close = close  # type: ignore[method-assign]
    try:
        yield
    finally:
        Worker.close = unbounded  # type: ignore[method-assign]
