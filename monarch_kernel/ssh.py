"""Reaching remote hosts over SSH (the only module that imports asyncssh).

A host agent is started with `python -m monarch_kernel.agent --stdio` over an
authenticated SSH connection; its stdin/stdout are bridged to one end of a local
socketpair, so the controller talks to remote agents exactly as to local ones. Host
keys are checked against known_hosts (asyncssh's default, or the options given); the
user's ~/.ssh/config is read as OpenSSH would.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shlex
import socket
from dataclasses import dataclass, field
from typing import Any

from .errors import MeshStartError

DEFAULT_CONNECT_TIMEOUT_S = 30.0
KEEPALIVE_S = 1.0


@dataclass(frozen=True)
class SSHTarget:
    """Where to connect: `host`, `user@host`, `host:port` or `user@host:port`."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> SSHTarget:
        """Parse a target as written in `%mesh up ssh ...`."""
        user, _, rest = text.rpartition("@")
        host, sep, port = rest.partition(":")
        if not host or (sep and not port.isdigit()):
            raise ValueError(f"bad SSH host {text!r}: expected host, user@host or user@host:port")
        return cls(host, user or None, int(port) if sep else None)

    def __str__(self) -> str:
        return (f"{self.user}@" if self.user else "") + self.host + (f":{self.port}" if self.port else "")


@dataclass
class RemoteAgent:
    """An agent process started over SSH, and the local socket bridged to it."""

    target: SSHTarget
    connection: Any  # asyncssh.SSHClientConnection
    process: Any  # asyncssh.SSHClientProcess
    sock: socket.socket
    peer_address: str
    _bridge: socket.socket = field(repr=False, default=None)  # type: ignore[assignment]
    python: str = "python3"
    pumps: list = field(default_factory=list, repr=False)
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=30), repr=False)

    def close(self) -> None:
        """Close the SSH connection (the agent exits when its stdin closes)."""
        self.connection.close()

    async def explain_exit(self, timeout: float = 3.0) -> str:
        """Why the agent ended: exit status and stderr, with advice for common causes."""
        try:
            await asyncio.wait_for(asyncio.gather(self.process.wait_closed(), *self.pumps), timeout)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - explain what we have
            pass
        tail = "\n".join(self.stderr_tail)
        status = self.process.exit_status
        if "No module named" in tail and "monarch_kernel" in tail:
            return (f"monarch_kernel is not importable on host {self.target} with {self.python}. Install it "
                    f"there (pip install monarch-kernel), point python= at an environment that has it, or "
                    f"pass ship_package=True (%mesh up ssh ... --ship) to copy this package's source to a "
                    f"temporary folder on the host for this session")
        if status == 127:
            return f"{self.python} was not found on host {self.target} (exit status 127); pass python=/path/to/python"
        return f"the agent on host {self.target} exited (status {status})" + (f":\n{tail}" if tail else "")


def _advice(target: SSHTarget, exc: BaseException) -> str:
    import asyncssh

    host = target.host
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return (f"the host key of {host} is not in known_hosts or does not match it ({exc.reason}). "
                f"Check the key's fingerprint with the host's owner, then add it, e.g. by connecting "
                f"once with `ssh {target}` and accepting it; monarch_kernel never accepts unknown keys")
    if isinstance(exc, asyncssh.PermissionDenied):
        return (f"{host} refused our credentials ({exc.reason}). Load a key into ssh-agent, or set "
                f"IdentityFile/User for {host} in ~/.ssh/config")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"{host} did not answer in time; check that it is up and reachable (or raise connect_timeout)"
    if isinstance(exc, asyncssh.ConfigParseError):
        return f"your SSH config could not be read: {exc}"
    if isinstance(exc, OSError):
        return f"cannot reach {host}: {exc.strerror or exc}. Check the name, port and network"
    return f"{type(exc).__name__}: {exc}"


async def connect(target: SSHTarget, *, options: dict[str, Any] | None = None,
                  timeout: float = DEFAULT_CONNECT_TIMEOUT_S):
    """Open an SSH connection, translating failures into MeshStartError with advice."""
    import asyncssh

    opts = dict(options or {})
    if target.user:
        opts["username"] = target.user
    if target.port:
        opts["port"] = target.port
    opts.setdefault("keepalive_interval", KEEPALIVE_S)
    opts.setdefault("keepalive_count_max", 3)
    try:
        return await asyncio.wait_for(asyncssh.connect(target.host, **opts), timeout)
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
        raise MeshStartError(f"host {target}: {_advice(target, exc)}") from exc


def agent_command(*, python: str, name: str, setup: str | None, env: dict[str, str],
                  pythonpath: str | None = None) -> str:
    """The remote shell command that starts an agent speaking on its stdin/stdout."""
    assigns = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    extra = ""
    if pythonpath:
        assigns.append(f'PYTHONPATH={shlex.quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
        extra = f" --cleanup {shlex.quote(pythonpath)}"
    run = (f"exec env {' '.join(assigns)} " if assigns else "exec ") + (
        f"{shlex.quote(python)} -m monarch_kernel.agent --stdio --host {shlex.quote(name)}{extra}")
    return f"{setup} && {run}" if setup else run


async def start_agent(target: SSHTarget, *, name: str, python: str, setup: str | None,
                      env: dict[str, str], options: dict[str, Any] | None, timeout: float,
                      stderr_path: str, ship_package: bool = False) -> RemoteAgent:
    """Connect to a host and start its agent; returns the bridged local socket."""
    conn = await connect(target, options=options, timeout=timeout)
    try:
        pythonpath = await _ship_package(conn) if ship_package else None
        ours, theirs = socket.socketpair()
        command = agent_command(python=python, name=name, setup=setup, env=env, pythonpath=pythonpath)
        process = await conn.create_process(command, encoding=None)
        peer = conn.get_extra_info("peername")[0]
        agent = RemoteAgent(target, conn, process, ours, peer, theirs, python=python)
        agent.pumps = [asyncio.ensure_future(_bridge(process, theirs)),
                       asyncio.ensure_future(_keep_stderr(process, stderr_path, agent.stderr_tail))]
        return agent
    except BaseException:
        conn.close()
        raise


async def _socket_to_channel(sock: socket.socket, process) -> None:
    """Forward what the controller writes on the socketpair to the agent's stdin."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    try:
        while True:
            data = await loop.sock_recv(sock, 1 << 16)
            if not data:
                break
            process.stdin.write(data)
            await process.stdin.drain()
    except Exception:  # noqa: BLE001 - connection lost or closed: the pump ends
        pass
    finally:
        try:
            process.stdin.write_eof()
        except Exception:  # noqa: BLE001 - connection lost or closed: the pump ends
            pass


async def _channel_to_socket(process, sock: socket.socket) -> None:
    """Forward the agent's stdout to the socketpair until the agent is gone."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            data = await process.stdout.read(1 << 16)
            if not data:
                break
            await loop.sock_sendall(sock, data)
    except Exception:  # noqa: BLE001 - connection lost or closed: the pump ends
        pass


async def _bridge(process, sock: socket.socket) -> None:
    """Pump both directions; when the agent's output ends, stop and close our end.

    The socket is closed only after the other pump is cancelled (which unregisters it
    from the event loop): closing a socket the loop still watches would leave a stale
    registration that a later socket reusing the descriptor number would inherit.
    """
    inbound = asyncio.ensure_future(_socket_to_channel(sock, process))
    try:
        await _channel_to_socket(process, sock)
    finally:
        inbound.cancel()
        try:
            await inbound
        except BaseException:  # noqa: BLE001 - cancelled, or the pump's own end
            pass
        sock.close()


async def _keep_stderr(process, path: str, tail: collections.deque) -> None:
    """Append the agent's stderr to its log file and keep the last lines in memory."""
    with open(path, "ab") as log:
        while True:
            try:
                data = await process.stderr.read(1 << 16)
            except Exception:  # noqa: BLE001 - connection lost or closed: the pump ends
                break
            if not data:
                break
            log.write(data)
            log.flush()
            tail.extend(line for line in data.decode("utf-8", "replace").splitlines() if line.strip())


async def _ship_package(conn) -> str:
    """Copy this monarch_kernel's source to a private temporary folder on the host."""
    here = os.path.dirname(os.path.abspath(__file__))
    made = await conn.run("mktemp -d -t monarch-pkg-XXXXXX", check=True)
    remote = made.stdout.strip()
    async with conn.start_sftp_client() as sftp:
        await sftp.put(here, f"{remote}/monarch_kernel", recurse=True)
    return remote
