"""Reaching remote hosts over SSH (the only module that imports asyncssh).

A host agent is started with `python -m monarch_kernel.agent --stdio` over an
authenticated SSH connection; the controller speaks the same framed protocol on the
process's stdin/stdout (ChannelConnection) as on a local agent's socketpair. Host
keys are checked against known_hosts (asyncssh's default, or the options given); the
user's ~/.ssh/config is read as OpenSSH would.
"""

from __future__ import annotations

import asyncio
import collections
import os
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import MeshStartError
from .transport import ConnectionClosed, FrameProtocol, encode

DEFAULT_CONNECT_TIMEOUT_S = 30.0
KEEPALIVE_S = 1.0
# AES-GCM first: one AEAD call per packet, where asyncssh's chacha20-poly1305 builds new
# cipher objects for every packet (~15% of a no-op broadcast's time on a 2x2 mesh). Used
# only when neither the caller nor an SSH config file chooses ciphers.
PREFERRED_CIPHERS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
                     "aes128-ctr", "aes192-ctr", "aes256-ctr"]


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
    peer_address: str
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
    if "encryption_algs" not in opts and not _config_sets_ciphers(opts.get("config")):
        opts["encryption_algs"] = PREFERRED_CIPHERS
    opts.setdefault("keepalive_count_max", 3)
    try:
        return await asyncio.wait_for(asyncssh.connect(target.host, **opts), timeout)
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
        raise MeshStartError(f"host {target}: {_advice(target, exc)}") from exc


def _config_sets_ciphers(config: Any) -> bool:
    """Whether an SSH config file in use (the given ones, or ~/.ssh/config) names Ciphers."""
    if config is None:
        paths = [os.path.expanduser("~/.ssh/config")]
    else:
        paths = [config] if isinstance(config, (str, os.PathLike)) else list(config)
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                if any(line.strip().lower().startswith("ciphers") for line in f):
                    return True
        except OSError:
            continue
    return False


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
        command = agent_command(python=python, name=name, setup=setup, env=env, pythonpath=pythonpath)
        process = await conn.create_process(command, encoding=None)
        peer = conn.get_extra_info("peername")[0]
        agent = RemoteAgent(target, conn, process, peer, python=python)
        agent.pumps = [asyncio.ensure_future(_keep_stderr(process, stderr_path, agent.stderr_tail))]
        return agent
    except BaseException:
        conn.close()
        raise


class ChannelConnection:
    """Framed messages over an SSH process's stdin/stdout (the interface of AsyncConnection)."""

    def __init__(self, process, on_message: Callable[[Any], None], on_close: Callable[[Exception | None], None]):
        self._process = process
        self._protocol = FrameProtocol(on_message, on_close)
        self._closed = False
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        error: Exception | None = None
        try:
            while True:
                data = await self._process.stdout.read(1 << 16)
                if not data:
                    break
                self._protocol.data_received(data)
        except Exception as exc:  # noqa: BLE001 - the connection is gone, whatever the cause
            error = exc
        finally:
            self._closed = True
            self._protocol.connection_lost(error)

    def send(self, msg: Any) -> None:
        """Queue one message (never blocks; asyncssh buffers and flow-controls)."""
        self.send_chunks(encode(msg))

    def send_chunks(self, chunks: list) -> None:
        """Queue an already encoded frame."""
        if self._closed:
            raise ConnectionClosed("the SSH channel is closed")
        self._process.stdin.write(b"".join(chunks) if len(chunks) > 1 else bytes(chunks[0]))

    def close(self) -> None:
        """Close the channel (the agent sees end of input and exits)."""
        self._closed = True
        self._process.close()

    @property
    def closed(self) -> bool:
        """Whether the channel is closed."""
        return self._closed


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
    name = f"monarch-pkg-{secrets.token_hex(8)}"
    made = await conn.run(f'd="${{TMPDIR:-/tmp}}/{name}" && mkdir -m 700 "$d" && echo "$d"', check=True)
    remote = made.stdout.strip()
    async with conn.start_sftp_client() as sftp:
        await sftp.put(here, f"{remote}/monarch_kernel", recurse=True)
    return remote
