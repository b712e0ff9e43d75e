"""Test hosts: network namespaces on a bridge, each running a real OpenSSH sshd.

Addresses come from 198.18.0.0/15 (the benchmarking range). Everything is created with
a per-run tag and torn down by `stop()`, which is safe to call after a partial start.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

SSHD = "/usr/sbin/sshd"


def unavailable_reason() -> str | None:
    """Why these hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "test hosts need root (ip netns, sshd)"
    for tool in ("ip", "ssh-keygen", SSHD):
        if shutil.which(tool) is None and not os.path.exists(tool):
            return f"{tool} is not installed (apt-get install openssh-server openssh-client iproute2)"
    probe = f"mkprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    done = subprocess.run(full, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed: {done.stderr.strip()}")


@dataclass
class Host:
    """One test host."""

    alias: str
    address: str
    netns: str
    veth: str
    sshd: subprocess.Popen | None = None


class SSHTestHosts:
    """N hosts named host-0, host-1, ... reachable as root with a test-only key."""

    def __init__(self, count: int, workdir: str, client_alive: tuple[int, int] = (2, 2),
                 workspace_quota: dict[int, int] | None = None, scratch_size: str = "1g"):
        """client_alive: sshd's ClientAliveInterval and ClientAliveCountMax (how long a silent client lasts).

        workspace_quota: host index -> bytes: that host's workspace folder is a tmpfs this small (a full disk).
        """
        self.client_alive = client_alive
        self.workspace_quota = workspace_quota or {}
        self.scratch_size = scratch_size
        self.tag = f"{os.getpid() % 100000}"
        self.workdir = workdir
        self.bridge = f"mkbr{self.tag}"
        self.hosts = [Host(f"host-{i}", f"198.18.0.{10 + i}", f"mk{self.tag}h{i}", f"mk{self.tag}v{i}")
                      for i in range(count)]
        self.key = os.path.join(workdir, "id_test")
        self.known_hosts = os.path.join(workdir, "known_hosts")
        self.config = os.path.join(workdir, "ssh_config")
        # each host mounts its own tmpfs here (in its sshd's mount namespace): a path that
        # differs per host, as on real machines (the test machine itself sees an empty folder)
        self.scratch = os.path.join(workdir, "scratch")

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> SSHTestHosts:
        """Start the hosts for a `with` block (a fixture's); a partial start is torn down before raising."""
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SSHTestHosts:
        """Create the network and start every sshd; raises on failure (call stop())."""
        os.makedirs("/run/sshd", exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key], check=True)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", "198.18.0.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        known, config = [], []
        for host in self.hosts:
            self._make_host(host)
            pub = self._host_key(host)
            known.append(f"{host.alias},{host.address} {pub}")
            config.append(f"Host {host.alias}\n  HostName {host.address}\n  User root\n"
                          f"  IdentityFile {self.key}\n  UserKnownHostsFile {self.known_hosts}\n")
        with open(self.known_hosts, "w") as f:
            f.write("\n".join(known) + "\n")
        with open(self.config, "w") as f:
            f.write("\n".join(config))
        for host in self.hosts:
            self._wait_for_sshd(host)
        return self

    def _make_host(self, host: Host) -> None:
        _run("ip", "netns", "add", host.netns)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", host.veth + "p")
        _run("ip", "link", "set", host.veth + "p", "netns", host.netns)
        _run("ip", "link", "set", host.veth, "master", self.bridge)
        _run("ip", "link", "set", host.veth, "up")
        _run("ip", "link", "set", "lo", "up", ns=host.netns)
        _run("ip", "link", "set", host.veth + "p", "name", "eth0", ns=host.netns)
        _run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.netns)
        _run("ip", "link", "set", "eth0", "up", ns=host.netns)

    def _host_key(self, host: Host) -> str:
        key = os.path.join(self.workdir, f"{host.alias}_host_key")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        authorized = os.path.join(self.workdir, "authorized_keys")
        shutil.copy(self.key + ".pub", authorized)
        cfg = os.path.join(self.workdir, f"{host.alias}_sshd_config")
        with open(cfg, "w") as f:
            f.write(
                f"ListenAddress {host.address}\nPort 22\nHostKey {key}\n"
                f"PidFile {self.workdir}/{host.alias}.pid\nAuthorizedKeysFile {authorized}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                f"ClientAliveInterval {self.client_alive[0]}\nClientAliveCountMax {self.client_alive[1]}\n"
                "LogLevel ERROR\n"
                f"SetEnv MONARCH_KERNEL_WORKSPACE_ROOT={self.workspaces(host)}\n"
                "Subsystem sftp internal-sftp\n"
            )
        log = open(os.path.join(self.workdir, f"{host.alias}_sshd.log"), "wb")
        os.makedirs(self.scratch, exist_ok=True)
        mounts = f"mount -t tmpfs -o size={self.scratch_size},mode=0700 tmpfs {self.scratch} && "
        quota = self.workspace_quota.get(self.hosts.index(host))
        if quota is not None:
            os.makedirs(self.workspaces(host), exist_ok=True)
            mounts += f"mount -t tmpfs -o size={quota},mode=0700 tmpfs {self.workspaces(host)} && "
        # `ip netns exec` gives sshd a mount namespace of its own: the tmpfs is this host's alone
        host.sshd = subprocess.Popen(["ip", "netns", "exec", host.netns, "sh", "-c", f"{mounts}exec {SSHD} -D -e -f {cfg}"],
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        with open(key + ".pub") as f:
            return " ".join(f.read().split()[:2])

    def workspaces(self, host: Host) -> str:
        """Where this host keeps synced workspaces (its own folder: each host's copy is really its own)."""
        return os.path.join(self.workdir, f"{host.alias}-workspaces")

    def _wait_for_sshd(self, host: Host, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host.address, 22), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {host.alias} ({host.address}) did not come up")

    def stop(self) -> None:
        """Kill everything in the namespaces, then remove them and the bridge."""
        for host in self.hosts:
            for pid in self.pids(host):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            if host.sshd is not None:
                host.sshd.wait(timeout=5)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    # ------------------------------------------------------------ inspection and faults
    def pids(self, host: Host) -> list[int]:
        """Processes running in a host's namespace."""
        done = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def cut_link(self, host: Host) -> None:
        """Take the host's network interface down (as if its cable were pulled)."""
        _run("ip", "link", "set", "eth0", "down", ns=host.netns)

    def restore_link(self, host: Host) -> None:
        """Bring a cut link back up."""
        _run("ip", "link", "set", "eth0", "up", ns=host.netns)
        _run("ip", "addr", "replace", f"{host.address}/24", "dev", "eth0", ns=host.netns)

    def install_home(self, home: str) -> str:
        """Write an OpenSSH-style ~/.ssh under `home` for these hosts (for HOME=home)."""
        ssh_dir = os.path.join(home, ".ssh")
        os.makedirs(ssh_dir, mode=0o700, exist_ok=True)
        shutil.copy(self.config, os.path.join(ssh_dir, "config"))
        shutil.copy(self.known_hosts, os.path.join(ssh_dir, "known_hosts"))
        return home

    def connect_options(self) -> dict:
        """asyncssh options that use this test network's config, key and known_hosts."""
        return {"config": [self.config], "known_hosts": self.known_hosts, "client_keys": [self.key]}
