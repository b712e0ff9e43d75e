"""A freshly forked rank's start: its process group and parent-death signal, the Worker that serves
it, the heartbeat thread that answers its agent's pings, and `setup()` (torch.distributed)."""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from monarch_kernel.rank.cell import describe_failure
from monarch_kernel.rank.debugging import untraced
from monarch_kernel.rank.runs import RunKind
from monarch_kernel.rank.worker import READY_REQ, Worker, WorkerConfig
from monarch_kernel.wire.handshake_gate import raise_descriptor_limit
from monarch_kernel.wire.messages import Result
from monarch_kernel.wire.serialization import seal
from monarch_kernel.wire.transport import BlockingConnection


def _heartbeat(sock: socket.socket, activity) -> None:
    """Answer every ping of the agent with what this rank is doing ("" when idle)."""
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data or not _tell(sock, _activity_or_nothing(activity)):
            return


def _activity_or_nothing(activity) -> str:
    try:
        return activity()
    except Exception:  # noqa: BLE001 - a status phrase must never cost the rank its heartbeat
        return ""


def _tell(sock: socket.socket, activity: str) -> bool:
    """One heartbeat answer (also sent unasked when the rank stops being busy)."""
    try:
        sock.sendall(b"." + activity.encode("utf-8", "replace")[:300] + b"\n")
    except OSError:
        return False
    return True


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask Linux to send `signum` to this process when its parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _end_process_group(signum: int, frame: Any) -> None:
    """SIGTERM on a rank (its agent stops it, or died): take everything it started along."""
    os.killpg(0, signal.SIGKILL)


def run_rank(conn_sock: socket.socket, hb_sock: socket.socket, config: WorkerConfig, setup) -> None:
    """Entry point of a freshly forked rank. `setup()` initializes torch.distributed."""
    parent = os.getppid()
    # the rank leads its own process group: when its agent goes (even by SIGKILL), the whole
    # group goes, with whatever the user's code started (subprocesses, DataLoader workers)
    signal.signal(signal.SIGTERM, _end_process_group)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)
    faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)
    raise_descriptor_limit()  # (also when the agent could not: a rank listens for calls from other hosts)
    conn = BlockingConnection(conn_sock)
    worker = Worker(conn, config)
    worker.install()
    untraced(threading.Thread(target=_heartbeat, args=(hb_sock, worker.activity), name="heartbeat",
                              daemon=True)).start()
    worker.actors.doing.on_idle = lambda: None if _tell(hb_sock, worker.activity()) else None
    started = time.time()
    failure = None
    run = worker.runs.begin(READY_REQ, RunKind.REQUEST, "set-up")  # (torch.distributed's rendezvous, say)
    try:
        summary = worker.runs.user_code(run, setup)
    except BaseException as exc:  # noqa: BLE001
        failure = describe_failure(exc)
        summary = None
    finally:
        worker.runs.end(run)
    worker.flush_streams()
    conn.send(Result(READY_REQ, config.rank, seal(summary), failure, started, time.time()))
    if failure is None:
        worker.serve()
