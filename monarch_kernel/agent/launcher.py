"""Forking a rank from the (warm) host agent, and what the child does to become one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from monarch_kernel.core.termtext import LineLog
from monarch_kernel.rank.dist import StoreSpec
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.fd_marks import FdMarkWriter, fd_mark_path
from monarch_kernel.wire.transport import AsyncConnection

STDERR_TAIL_LINES = 20


class RankSupervisor(Protocol):
    """What a forked rank reports to (the agent's RankSet)."""

    host: str

    def on_rank_message(self, rank: int, msg: Any) -> None:
        """A message from the rank."""

    def on_rank_fd_output(self, rank: int, stream: str, data: bytes, total: int | None) -> None:
        """Bytes the rank wrote to its real fd 1 or 2 (total: its fd bytes so far with these, on
        the notebook's machine; see wire/fd_marks.py)."""

    def on_rank_exit(self, rank: int) -> None:
        """The rank's pidfd became readable: it exited."""

    def on_pong(self, rank: int) -> None:
        """The rank answered a heartbeat."""


@dataclass
class RankProcess:
    """The agent's view of one forked rank."""

    spec: m.RankSpec
    pid: int
    pidfd: int
    hb_sock: socket.socket
    conn: AsyncConnection | None = None
    ready: asyncio.Future[m.Result] | None = None
    last_pong: float = field(default_factory=time.monotonic)
    responsive: bool = True
    stopping: bool = False  # the controller asked it to stop: its exit is expected
    activity: str = ""  # what its actors run, from its latest heartbeat answer
    collective: str = ""  # the collective its main thread waits in, from the same answer
    requests: dict[int, str] = field(default_factory=dict)  # req_id -> label of the requests seen running
    running: int | None = None  # the request it runs now (its latest heartbeat answer), if any
    stderr_tail: LineLog = field(default_factory=lambda: LineLog(STDERR_TAIL_LINES))
    fd_mark: FdMarkWriter | None = None  # on the notebook's machine: how much fd output was passed on
    outputs: dict[int, str] = field(default_factory=dict)  # its fd 1 and 2 pipes still open here: fd -> stream

async def fork_rank(agent: RankSupervisor, spec: m.RankSpec, start: m.StartRanks,
                    store: StoreSpec) -> RankProcess:
    """Fork one rank from the (warm) agent process and wire it to the agent's loop."""
    mark = FdMarkWriter(fd_mark_path(start.shm_dir, spec.rank)) if start.shm_dir else None
    parent_conn, child_conn = socket.socketpair()
    parent_hb, child_hb = socket.socketpair()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns from here
        try:
            parent_conn.close()
            parent_hb.close()
            _become_rank(spec, start, child_conn, child_hb, out_w, err_w, store, agent.host)
        except BaseException:  # noqa: BLE001 - its start failed: say why on its stderr (the start error shows it)
            with contextlib.suppress(BaseException):
                os.write(2, f"rank {spec.rank} could not start:\n{traceback.format_exc()}".encode(errors="replace"))
        finally:
            os._exit(70)
    for fd in (out_w, err_w):
        os.close(fd)
    child_conn.close()
    child_hb.close()
    loop = asyncio.get_running_loop()
    proc = RankProcess(spec, pid, os.pidfd_open(pid), parent_hb, ready=loop.create_future(), fd_mark=mark)
    parent_hb.setblocking(False)
    loop.add_reader(proc.pidfd, agent.on_rank_exit, spec.rank)
    loop.add_reader(parent_hb.fileno(), agent.on_pong, spec.rank)
    for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
        os.set_blocking(fd, False)
        proc.outputs[fd] = stream
        loop.add_reader(fd, _pump_fd, loop, fd, agent, proc, stream)
    proc.conn = await AsyncConnection.from_socket(
        parent_conn,
        partial(agent.on_rank_message, spec.rank),
        lambda exc: None,  # the pidfd reports the exit, with its status
    )
    return proc


def drain_outputs(agent: RankSupervisor, proc: RankProcess) -> None:
    """Pass on what an exited rank wrote to its fds that was not read yet (its last lines: why it failed)."""
    loop = asyncio.get_running_loop()
    for fd, stream in list(proc.outputs.items()):
        while fd in proc.outputs and _pump_fd(loop, fd, agent, proc, stream):
            pass


def _pump_fd(loop: asyncio.AbstractEventLoop, fd: int, agent: RankSupervisor, proc: RankProcess, stream: str) -> bool:
    """Read what is there on one of a rank's fds and pass it on; whether there was something. What it wrote to
    stderr is kept for its exit report here, on `proc` itself: a rank that fails at once may be read from before
    the agent has it among its ranks (its start is still being wired up)."""
    mark, outputs = proc.fd_mark, proc.outputs
    if mark is not None:
        mark.reading()  # (the rank waits for passed_on before it trusts the count)
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        data = None
    except OSError:
        data = b""
    if data:
        if stream == "stderr":
            proc.stderr_tail.write("stderr", data.decode("utf-8", "replace"))
        agent.on_rank_fd_output(proc.spec.rank, stream, data, None if mark is None else mark.count + len(data))
    if mark is not None:
        mark.passed_on(len(data or b""))
    if data is not None and not data:
        loop.remove_reader(fd)
        os.close(fd)
        outputs.pop(fd, None)
    return bool(data)


def _become_rank(spec: m.RankSpec, start: m.StartRanks, conn: socket.socket, hb: socket.socket,
                 out_w: int, err_w: int, store: StoreSpec, host: str) -> None:
    """In the forked child: detach from the agent's state, set up, and serve forever."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    keep = {0, 1, 2, conn.fileno(), hb.fileno()} | ({store.listen_fd} if store.listen_fd is not None else set())
    _close_fds_except(keep)
    if spec.bind:  # before any thread starts, so that all of them are pinned
        from monarch_kernel.rank.binding import BindingError, apply_binding

        try:
            apply_binding(dict(spec.bind))
        except BindingError as exc:
            os.write(2, f"rank {spec.rank} cannot start: {exc}\n".encode())
            os._exit(70)
    from monarch_kernel.rank.dist import init_process_group, limit_threads, rank_environment
    from monarch_kernel.rank.entry import run_rank
    from monarch_kernel.rank.exit_work import forget_the_agents

    forget_the_agents()
    from monarch_kernel.rank.worker import WorkerConfig

    os.environ.update(start.env)
    os.environ.update(spec.env)
    os.environ.update(rank_environment(spec, start.dist, store.port, start.node_rank))
    limit_threads(spec.local_world_size)

    def setup() -> str:
        return init_process_group(spec, start.dist, store)

    run_rank(conn, hb, WorkerConfig(spec.rank, host, start.shm_dir, start.mesh), setup)
    os._exit(0)


def _close_fds_except(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
