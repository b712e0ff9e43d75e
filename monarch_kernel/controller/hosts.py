"""Hosts of a mesh: how the controller starts and reaches their agents (what they are: `hostspec`).

A local host's agent is a child process on a socketpair; a remote host's agent is
started over SSH and speaks on the SSH channel (see `ssh`). Either way the controller
talks the same framed protocol.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from monarch_kernel.controller.hostspec import DEFAULT_PYTHON, HostKind, HostSpec
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.package import PACKAGE_PARENT
from monarch_kernel.wire.transport import AsyncConnection

EXIT_STATUS_WAIT_S = 2.0  # how long a start that failed waits for the local agent's exit status


class AgentHandle(Protocol):
    """The controller's hold on a remote host agent: an SSH session (`ssh.RemoteAgent`), a Slurm job
    step (`slurm_step.SlurmStep`) or a Ray node's agent (`ray_agent.RayAgent`). Local agents are a process
    and a socketpair instead."""

    scheduled: bool  # a scheduler (Slurm, Ray) can say why the agent or its ranks went away: see below

    def attach(self, on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]) -> Any:
        """The framed connection to the agent (or a coroutine that makes it)."""

    async def explain_exit(self) -> str:
        """Why the agent is gone (for start-up failures)."""

    def job_ended(self) -> str:
        """What the scheduler says ended the job, if it did ("" if nothing); blocking."""

    def lost_reason(self) -> str:
        """What the scheduler says of the agent's node when the link is lost ("" if nothing); blocking."""

    async def remove_shipped(self) -> None:
        """Remove the package copy shipped to the host, if any."""

    async def wait_closed(self) -> None:
        """Until the agent's session or step has ended."""

    def close(self) -> None:
        """End the session or step."""

    def let_go(self) -> None:
        """Let go of a persistent mesh's agent: our connection ends, the agent and its ranks go on."""


class Connection(Protocol):
    """A framed link to one host agent: a socketpair or pipe (`wire/transport.AsyncConnection`), an
    SSH channel (`controller/ssh_channel.ChannelConnection`) or a sealed TCP link (`wire/relay_link.RelayLink`)."""

    bytes_sent: int  # what send() has queued in all

    @property
    def last_received(self) -> float:
        """When bytes last arrived (time.monotonic()), complete frame or not."""

    @property
    def closed(self) -> bool:
        """Whether the link is closed."""

    def backlog(self) -> int:
        """Bytes queued for the agent that it has not taken yet."""

    def send(self, msg: Any) -> None:
        """Queue one message (never blocks)."""

    def send_chunks(self, chunks: list) -> None:
        """Queue an already encoded frame."""

    def close(self) -> None:
        """Close the link (the agent sees its end)."""


@dataclass
class HostConnection:
    """A started agent: how to talk to it and how to end it."""

    sock: socket.socket | None  # local agents: our end of the socketpair
    address: str  # the address the controller reached the host at
    process: subprocess.Popen | None = None  # local agents we started
    remote: AgentHandle | None = None  # remote ones: SSH or a Slurm job step
    local_pid: int | None = None  # a local agent's pid (one another kernel started, too, once attached)

    @property
    def is_local(self) -> bool:
        """Whether the agent runs on this machine (its ranks have direct lanes and shared memory)."""
        return self.local_pid is not None

    async def connect(self, on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]) -> Any:
        """A framed connection to the agent (socketpair, or the SSH channel)."""
        if self.remote is not None:
            connection = self.remote.attach(on_message, on_close)
            return await connection if asyncio.iscoroutine(connection) else connection
        assert self.sock is not None  # a local agent has its socketpair
        return await AsyncConnection.from_socket(self.sock, on_message, on_close)

    @property
    def pid(self) -> int | None:
        """The local agent's pid (None for a remote agent)."""
        return self.local_pid

    async def explain_exit(self, log_path: str) -> str:
        """Why the agent is gone (for start-up failures)."""
        if self.remote is not None:
            return await self.remote.explain_exit()
        try:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                tail = "".join(f.readlines()[-20:])
        except OSError:
            tail = ""
        code = self.process.poll() if self.process is not None else None
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while code is None and self.process is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # its connection closes a moment before it exits (longer on a busy machine)
            code = self.process.poll()
        if code is None:
            what = f"the local agent (pid {self.local_pid}) closed its connection while starting and still runs"
        else:
            what = f"the local agent exited (status {code})"
        return what + (f":\n{tail}" if tail else "")

    def kill_local(self, rank_pids: list[int]) -> None:
        """A local agent that stopped answering (SIGSTOP, wedged): SIGKILL it and its ranks' process groups."""
        if self.local_pid is None:
            return
        for pid in [self.local_pid, *rank_pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def close(self, timeout: float = 5.0) -> None:
        """Wait for the agent to exit (after Shutdown was sent); force it if it does not."""
        if self.process is not None:
            deadline = asyncio.get_running_loop().time() + timeout
            while self.process.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            if self.process.poll() is None:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait()
        if self.remote is not None:
            try:
                await asyncio.wait_for(self.remote.wait_closed(), timeout)
            except (TimeoutError, Exception):  # noqa: BLE001 - closing anyway
                pass
            await self.remote.remove_shipped()
            self.remote.close()


def spawn_local_agent(host: str, log_path: str, python: str | None = None, mesh_folders: tuple[str, ...] = (),
                      persist: bool = False) -> tuple[subprocess.Popen, socket.socket]:
    """Start a host agent on this machine, connected by a private socketpair.

    The agent gets its own session, so the kernel's SIGINT does not reach it; it dies
    with the thread that started it (PR_SET_PDEATHSIG) or when the socket closes. If the
    kernel is gone by then (killed), the agent removes `mesh_folders` as it exits. With `persist`
    it does not die with the kernel: a persistent mesh's agent waits for the next one.
    """
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    env.setdefault("MPLBACKEND", "Agg")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [python or sys.executable, "-m", "monarch_kernel.agent", "--fd", str(theirs.fileno()), "--host", host,
             *(arg for folder in mesh_folders for arg in ("--mesh-folder", folder)), *(["--persist"] if persist else [])],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, env=env, close_fds=True,
        )
    theirs.close()
    return proc, ours


async def open_host(spec: HostSpec, *, log_path: str, env: dict[str, str],
                    mesh_folders: tuple[str, ...] = (), persist: bool = False) -> HostConnection:
    """Start the agent of one host; raises MeshStartError with a per-host reason.

    mesh_folders: the kernel's folders for the mesh, which a local agent removes if it
    outlives the kernel. persist: the mesh may outlive the kernel.
    """
    if spec.kind == HostKind.LOCAL:
        python = None if spec.python == DEFAULT_PYTHON else spec.python  # (with_python_executable chose one)
        proc, sock = spawn_local_agent(spec.name, log_path, python=python, mesh_folders=mesh_folders, persist=persist)
        return HostConnection(sock, "127.0.0.1", process=proc, local_pid=proc.pid)
    if spec.kind == HostKind.WORKER:
        from monarch_kernel.controller.worker_hosts import open_worker

        to_agent, address, link = await open_worker(spec)
        return HostConnection(to_agent, address, remote=link)
    if spec.kind == HostKind.SLURM:
        from monarch_kernel.controller.slurm_step import SlurmStep

        step = SlurmStep.start(spec.options["job"], spec.target or spec.name, python=spec.python, setup=spec.setup,
                               env=env, log_path=log_path, address=spec.options["address"],
                               direct=spec.options.get("direct", True), persist=persist)
        return HostConnection(None, spec.options["address"], remote=step)
    if spec.kind == HostKind.RAY:
        from monarch_kernel.controller.ray_agent import RayAgent

        if "node" not in spec.options:
            raise MeshStartError(f"host {spec.name}: this Ray mesh was taken back by attach, and its agent there is "
                                 "gone; a new one needs a new reservation: %mesh down, then %mesh up ray again")
        agent = await RayAgent.start(spec.options["node"], name=spec.name, python=spec.python,
                                     env={**env, **spec.options.get("env", {})}, log_path=log_path)
        return HostConnection(None, spec.options["address"], remote=agent)
    from monarch_kernel.controller import ssh

    remote = await ssh.start_agent(
        ssh.SSHTarget.parse(spec.target or spec.name), name=spec.name, python=spec.python,
        setup=spec.setup, env=env, options=spec.options, timeout=spec.connect_timeout_s,
        stderr_path=log_path, ship_package=spec.ship_package, persist=persist)
    return HostConnection(None, remote.peer_address, remote=remote)
