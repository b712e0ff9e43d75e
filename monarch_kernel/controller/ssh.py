"""Reaching remote hosts over SSH (with ssh_channel.py, the only modules that import asyncssh).

A host agent is started with `python -m monarch_kernel.agent --stdio` over an
authenticated SSH connection; the controller speaks the same framed protocol on the
process's stdin/stdout (`ssh_channel.ChannelConnection`) as on a local agent's socketpair. Host
keys are checked against known_hosts (asyncssh's default, or the options given); the
user's ~/.ssh/config is read as OpenSSH would.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.controller.hostspec import ReachedAgentHandle
from monarch_kernel.controller.ssh_channel import ChannelConnection, agent_session
from monarch_kernel.core.addresses import is_unspecified
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.package import PACKAGE_DIR

DEFAULT_CONNECT_TIMEOUT_S = 30.0
KEEPALIVE_S = 1.0
# AES-GCM first: one AEAD call per packet, where asyncssh's chacha20-poly1305 builds new
# cipher objects for every packet (~15% of a no-op broadcast's time on a 2x2 mesh). Used
# only when neither the caller nor an SSH config file chooses ciphers.
PREFERRED_CIPHERS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
                     "aes128-ctr", "aes192-ctr", "aes256-ctr"]


@dataclass(frozen=True)
class SSHTarget:
    """Where to connect: `host`, `user@host`, `host:port` or `user@host:port`.

    IPv6 addresses are written bare (`::1`, `user@fe80::1`) or in brackets, which a port
    needs: `[::1]:2222`.
    """

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> SSHTarget:
        """Parse a target as written in `%mesh up ssh ...`."""
        user, _, rest = text.rpartition("@")
        if rest.startswith("["):  # [v6 address] or [v6 address]:port
            host, close, after = rest[1:].partition("]")
            sep, port = after[:1], after[1:]
            if not close or ":" not in host or after[:1] not in ("", ":"):
                raise ValueError(f"bad SSH host {text!r}: expected [address] or [address]:port")
        elif rest.count(":") > 1:  # a bare IPv6 address: no port
            host, sep, port = rest, "", ""
        else:
            host, sep, port = rest.partition(":")
        if not host or (sep and not port.isdigit()):
            raise ValueError(f"bad SSH host {text!r}: expected host, user@host, user@host:port or [v6]:port")
        return cls(host, user or None, int(port) if sep else None)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (f"{self.user}@" if self.user else "") + host + (f":{self.port}" if self.port else "")


@dataclass
class RemoteAgent:
    """An agent process started over SSH: its channel, and the session reading it."""

    target: SSHTarget
    connection: Any  # asyncssh.SSHClientConnection
    channel: Any  # asyncssh.SSHClientChannel running the agent command
    session: Any  # _AgentSession: stdout frames to the controller, stderr to the host's log
    peer_address: str
    python: str = "python3"
    shipped: str | None = None  # the folder this package was copied to (--ship), removed at the end
    scheduled = False  # no scheduler to ask why the agent or its ranks went away

    def job_ended(self) -> str:
        """No job: SSH hosts run no scheduler."""
        return ""

    def lost_reason(self) -> str:
        """No scheduler to ask: the connection's own error says it."""
        return ""

    def attach(self, on_message: Callable[[Any], None],
               on_close: Callable[[Exception | None], None]) -> ChannelConnection:
        """The framed connection to the agent (call once)."""
        return ChannelConnection(self.channel, self.session, on_message, on_close)

    async def wait_closed(self) -> None:
        """Until the agent's channel is closed."""
        await asyncio.shield(self.session.lost)

    async def remove_shipped(self, timeout: float = 5.0) -> None:
        """Remove the copy of this package (an agent that ran removes it itself; one that failed cannot)."""
        if self.shipped is None or self.channel.get_exit_status() == 0:
            return  # nothing shipped, or the agent ran and removed it on its way out
        await _remove_folder(self.connection, self.shipped, timeout)

    def close(self) -> None:
        """Close the SSH connection (the agent exits when its stdin closes)."""
        self.connection.close()

    def let_go(self) -> None:
        """A persistent mesh's kernel ends: close the SSH connection (the agent waits for the next kernel)."""
        self.connection.close()

    async def explain_exit(self, timeout: float = 3.0) -> str:
        """Why the agent ended: exit status and stderr, with advice for common causes."""
        try:
            await asyncio.wait_for(self.wait_closed(), timeout)
        except (TimeoutError, Exception):  # noqa: BLE001 - explain what we have
            pass
        tail = "\n".join(self.session.stderr_tail)
        status = self.channel.get_exit_status()
        if "No module named" in tail and "monarch_kernel" in tail:
            return (f"monarch_kernel is not importable on host {self.target} with {self.python}. Install it "
                    f"there (pip install monarch-kernel), point python= at an environment that has it, or "
                    f"pass ship_package=True (%mesh up ssh ... --ship) to copy this package's source to a "
                    f"temporary folder on the host for this session")
        if status == 127:
            return f"{self.python} was not found on host {self.target} (exit status 127); pass python=/path/to/python"
        return f"the agent on host {self.target} exited (status {status})" + (f":\n{tail}" if tail else "")


@dataclass
class ForwardedAgent(ReachedAgentHandle):
    """The agent of a persistent mesh on an SSH host, reached by a new kernel: a new SSH connection that
    forwards a private local socket to the agent's Unix socket there (no TCP port is opened)."""

    target: SSHTarget
    connection: Any  # asyncssh.SSHClientConnection
    listener: Any  # its local path forwarding
    local_path: str
    peer_address: str

    async def explain_exit(self) -> str:
        """Why it is gone: as far as we can tell from here."""
        return f"the link to the agent on {self.target} through SSH ended"

    async def wait_closed(self) -> None:
        """Until the SSH connection is closed."""
        await self.connection.wait_closed()

    def close(self) -> None:
        """Close the forwarding and the SSH connection (the agent goes on)."""
        self.listener.close()
        self.connection.close()


async def forward_agent_socket(target: SSHTarget, *, options: dict[str, Any] | None, timeout: float,
                               remote_path: str, local_path: str) -> ForwardedAgent:
    """Connect to a host (host key checked as always) and forward `local_path` here (in a private folder)
    to the persistent agent's socket `remote_path` there."""
    conn = await connect(target, options=options, timeout=timeout)
    try:
        listener = await conn.forward_local_path(local_path, remote_path)
        peer = conn.get_extra_info("peername")
        return ForwardedAgent(target, conn, listener, local_path, str(peer[0]) if peer else target.host)
    except BaseException:
        conn.close()
        raise


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
    opts.setdefault("agent_forwarding", False)  # the user's SSH keys stay off the hosts unless asked for
    insecure = bool(opts.pop("insecure_no_host_key_check", False))
    if "known_hosts" in opts and opts["known_hosts"] is None and not insecure:
        raise MeshStartError(f"host {target}: known_hosts=None would accept any host key; pass "
                             "insecure_no_host_key_check=True as well if you really mean it")
    if "known_hosts" not in opts and not insecure and _config_disables_host_keys(target.host, opts.get("config")):
        raise MeshStartError(f"host {target}: the SSH config says `UserKnownHostsFile none`, which would accept "
                             "any host key; point it at a known_hosts file, or pass connect_options="
                             "{'insecure_no_host_key_check': True} if you really mean it")
    if "encryption_algs" not in opts and not _config_sets_ciphers(opts.get("config")):
        opts["encryption_algs"] = PREFERRED_CIPHERS
    opts.setdefault("keepalive_count_max", 3)
    try:
        return await asyncio.wait_for(asyncssh.connect(target.host, **opts), timeout)
    except (TimeoutError, OSError, asyncssh.Error) as exc:
        raise MeshStartError(f"host {target}: {_advice(target, exc)}") from exc


def _config_disables_host_keys(host: str, config: Any) -> bool:
    """Whether the SSH config in use turns host key checks off for host (`UserKnownHostsFile none`).

    The probe reads the same files the connection will: `config=()` is asyncssh's "the default
    ~/.ssh/config", which `connect` uses when no config is given (the options' own default, None,
    reads no file at all).
    """
    import asyncssh

    try:
        probe = asyncssh.SSHClientConnectionOptions(host=host, config=() if config is None else config)
    except (OSError, ValueError, asyncssh.Error):
        return False  # the real connection reports a broken config
    return probe.known_hosts is None


def _config_sets_ciphers(config: Any) -> bool:
    """Whether an SSH config file in use (the given ones, or ~/.ssh/config) names Ciphers."""
    if config is None:
        paths = [os.path.expanduser("~/.ssh/config")]
    else:
        paths = [os.fspath(config)] if isinstance(config, (str, os.PathLike)) else [os.fspath(c) for c in config]
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                if any(line.strip().lower().startswith("ciphers") for line in f):
                    return True
        except OSError:
            continue
    return False


def agent_command(*, python: str, name: str, setup: str | None, env: dict[str, str],
                  pythonpath: str | None = None, munge: bool = False, direct_address: str | None = None,
                  persist: bool = False) -> str:
    """The remote shell command that starts an agent speaking on its stdin/stdout.

    The environment's values never appear in it (other users of the host see command
    lines): with `env`, the agent reads them from its stdin first (`env_line`). With `munge`
    (a Slurm step, whose stdio is not private) the agent first keys an encrypted link with munge,
    offered over TCP on `direct_address` if given, and the environment comes on that link
    (`agent.direct_link`).
    """
    assigns = []
    extra = (" --env-stdin" if env and not munge else "") + (" --persist" if persist else "")
    if munge:
        extra += " --munge" + (f" --direct {shlex.quote(direct_address)}" if direct_address else "")
    if pythonpath:
        assigns.append(f'PYTHONPATH={shlex.quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
        extra += f" --cleanup {shlex.quote(pythonpath)}"
    run = (f"exec env {' '.join(assigns)} " if assigns else "exec ") + (
        f"{shlex.quote(python)} -m monarch_kernel.agent --stdio --host {shlex.quote(name)}{extra}")
    # a setup that ends in a comment or with '&' must not swallow the agent's start
    # and what it prints goes to stderr (the log), not into the protocol on stdout
    # ... and reads nothing of the agent's stdin (the environment and the secret come on it)
    return f"{{ {setup}\n}} </dev/null >&2 && {run}" if setup else run


def env_line(env: dict[str, str]) -> bytes:
    """What the agent reads first on its stdin with --env-stdin: the environment as JSON, after a
    line with its length in bytes (so an environment of any size arrives in one read)."""
    payload = json.dumps(env).encode()
    return b"%d\n" % len(payload) + payload


async def start_agent(target: SSHTarget, *, name: str, python: str, setup: str | None,
                      env: dict[str, str], options: dict[str, Any] | None, timeout: float,
                      stderr_path: str, ship_package: bool = False, persist: bool = False) -> RemoteAgent:
    """Connect to a host and start its agent; returns the bridged local socket."""
    conn = await connect(target, options=options, timeout=timeout)
    try:
        pythonpath = await _ship_package(conn) if ship_package else None
        command = agent_command(python=python, name=name, setup=setup, env=env, pythonpath=pythonpath, persist=persist)
        channel, session = await conn.create_session(lambda: agent_session(stderr_path), command,
                                                     encoding=None, request_pty=False)
        if env:
            channel.write(env_line(env))  # before any frame: the agent applies it, then imports torch
        peer = await _host_address(conn, target)
        return RemoteAgent(target, conn, channel, session, peer, python=python, shipped=pythonpath)
    except BaseException:
        if pythonpath:
            await _remove_folder(conn, pythonpath)
        conn.close()
        raise


async def _host_address(conn: Any, target: SSHTarget) -> str:
    """The host's address as the controller's side reaches it.

    Through a ProxyJump the connection has no peer address of its own: then the host says
    which of its addresses the jump host reached (`SSH_CONNECTION`), which is the one the
    other hosts of a cluster reach it at too.
    """
    peer = conn.get_extra_info("peername")
    address = str(peer[0]) if peer else ""
    if not is_unspecified(address):
        return address
    done = await conn.run('printf %s "$SSH_CONNECTION"', check=False, timeout=30)
    words = str(done.stdout or "").split()
    if len(words) >= 3 and not is_unspecified(words[2]):
        return words[2]
    raise MeshStartError(f"cannot tell which address {target.host} has (the connection went through a "
                         "jump host and SSH_CONNECTION is not set there); pass master_addr=... "
                         "(--master-addr) with an address the other hosts reach it at")


async def _remove_folder(conn: Any, path: str, timeout: float = 5.0) -> None:
    """Remove a folder on the host (best effort: the host may be gone, and then nothing is to be done)."""
    try:
        await asyncio.wait_for(conn.run(f"rm -rf {shlex.quote(path)}"), timeout)
    except Exception:  # noqa: BLE001 - best effort
        pass


async def _ship_package(conn) -> str:
    """Copy this monarch_kernel's source to a private temporary folder on the host."""
    name = f"monarch-pkg-{secrets.token_hex(8)}"
    # first sweep copies whose agent is gone without cleaning up (SIGKILL, a host reboot of /tmp aside):
    # an agent holds a lock on <copy>/.owner (and wrote its pid there) for its life: the copy is
    # stale when the lock is free (with util-linux's flock), or else when that pid is gone
    sweep = ('for old in "${TMPDIR:-/tmp}"/monarch-pkg-*; do [ -O "$old" ] && [ -f "$old/.owner" ] && '
             '{ if command -v flock >/dev/null; then flock -n "$old/.owner" true; '
             'else ! kill -0 "$(cat "$old/.owner")" 2>/dev/null; fi; } && rm -rf "$old"; done; ')
    made = await conn.run(sweep + f'd="${{TMPDIR:-/tmp}}/{name}" && mkdir -m 700 "$d" && echo "MONARCH_SHIPPED_TO=$d"',
                          check=True)
    # the last marked line: a shell profile that prints something cannot confuse it
    remote = [line for line in made.stdout.splitlines() if line.startswith("MONARCH_SHIPPED_TO=")][-1].split("=", 1)[1]
    async with conn.start_sftp_client() as sftp:
        await sftp.put(PACKAGE_DIR, f"{remote}/monarch_kernel", recurse=True)
    return remote
