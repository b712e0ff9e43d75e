"""Network namespaces on a bridge, for the test clusters (Slurm, Ray): each namespace one veth named eth0 with
its address, no default route (a lookup that would leave the bridge fails at once; with one, gloo's
rendezvous on the Ray nodes waited on DNS timeouts, 15 s per start). `remove()` kills whatever
still runs in the namespaces and deletes them and the links, also after a partial start."""

from __future__ import annotations

import os
import signal
import subprocess


def run(*cmd: str) -> None:
    """A command that must succeed (RuntimeError with its stderr otherwise)."""
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def namespace_pids(netns: str) -> list[int]:
    """Processes in a namespace."""
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of pids (those already gone are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ours(pids: list[int]) -> list[int]:
    """The pids whose command line names monarch_kernel (agents and ranks; a scheduler's own are not ours)."""
    def named(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"monarch_kernel" in f.read()
        except OSError:
            return False

    return [p for p in pids if named(p)]


class BridgedNamespaces:
    """A bridge at `gateway` (an address/24) and the namespaces added to it."""

    def __init__(self, bridge: str, gateway: str):
        self.bridge, self.gateway = bridge, gateway
        self.links: list[str] = []
        self.namespaces: list[str] = []

    def create(self) -> None:
        """The bridge, up, with the gateway's address (a lab that a killed test run left on it is removed first)."""
        self._remove_stale()
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        run("ip", "addr", "add", self.gateway, "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def add(self, netns: str, address: str) -> None:
        """Namespace `netns` on the bridge, its eth0 at address/24 (the bridge's end is `veth(netns)`)."""
        veth = self.veth(netns)
        run("ip", "netns", "add", netns)
        self.namespaces.append(netns)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
        self.links.append(veth)
        run("ip", "link", "set", veth + "p", "netns", netns)
        run("ip", "link", "set", veth, "master", self.bridge)
        run("ip", "link", "set", veth, "up")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "link", "set", veth + "p", "name", "eth0"],
                    ["ip", "addr", "add", f"{address}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"]):
            run("ip", "netns", "exec", netns, *cmd)

    def _remove_stale(self) -> None:
        """A bridge of ours that holds this gateway's address, left by a test run that was killed before its
        teardown (the labs are named `<prefix><pid>`): its namespaces' processes, namespaces and links go.
        Left in place, the address is routed to it and the new lab is unreachable. A live run's is an error."""
        held = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", self.gateway], capture_output=True, text=True)
        for line in held.stdout.splitlines():
            bridge = line.split()[1]
            owner = bridge.lstrip("abcdefghijklmnopqrstuvwxyz")
            if not owner.isdigit() or bridge[:-len(owner)] != self.bridge.rstrip("0123456789"):
                raise RuntimeError(f"{self.gateway} is taken by {bridge}, not a lab of this suite's: remove it")
            if os.path.exists(f"/proc/{owner}"):
                raise RuntimeError(f"{self.gateway} is held by {bridge}, the lab of a test run still running "
                                   f"(pid {owner}): let it finish")
            ports = subprocess.run(["ip", "-o", "link", "show", "master", bridge], capture_output=True, text=True)
            stale = BridgedNamespaces(bridge, self.gateway)
            stale.links = [bridge] + [p.split(":")[1].strip().split("@")[0] for p in ports.stdout.splitlines()]
            stale.namespaces = [veth[:-1] for veth in stale.links[1:] if veth.endswith("v")]
            stale.remove()

    @staticmethod
    def veth(netns: str) -> str:
        """The bridge's end of a namespace's link."""
        return f"{netns}v"

    def cut(self, netns: str) -> None:
        """The namespace drops off the network (its processes keep running)."""
        run("ip", "link", "set", self.veth(netns), "down")

    def remove(self) -> None:
        """Kill what runs in the namespaces, delete them and the links."""
        for netns in self.namespaces:
            kill_all(namespace_pids(netns))
        for netns in self.namespaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
