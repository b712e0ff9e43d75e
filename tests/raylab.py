"""A real Ray cluster for tests: a head node and worker nodes, each `ray start` in a network namespace.

The head runs the GCS and Ray's client server (`ray://198.18.2.2:10001`); each worker joins it with
`ray start --address` and declares logical GPUs (`--num-gpus`), so placement groups, GPU bundles and
Ray's accelerator ids work on a CPU machine. The notebook's side (the kernel, in the root namespace)
reaches the cluster as a Ray client, as a laptop or a login node would. Token authentication is on
(`RAY_AUTH_MODE=token`, the token in a private file named by `RAY_AUTH_TOKEN_PATH`: never on a command
line). Addresses come from 198.18.2.0/24 (the SSH hosts use 198.18.0.0/24, Slurm 198.19.0.0/24).
`stop()` kills every process in the namespaces and removes them, also after a partial start.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

HEAD_ADDRESS = "198.18.2.2"
CLIENT_PORT = 10001


def unavailable_reason() -> str | None:
    """Why the cluster cannot be made here (None when it can)."""
    if os.geteuid() != 0:
        return "a Ray test cluster needs root (network namespaces)"
    for tool in ("/usr/bin/nsenter", "/usr/bin/unshare"):
        if not os.path.exists(tool):
            return f"{tool} is missing (apt-get install util-linux)"
    if shutil.which("ip") is None:
        return "ip is missing (apt-get install iproute2)"
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # (not imported here: Ray reads its token settings at import)
        return "ray is not installed (pip install 'monarch-kernel[ray]')"
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def ray_command() -> str:
    """The `ray` launcher of this interpreter's environment."""
    return os.path.join(os.path.dirname(sys.executable), "ray")


class RayTestCluster:
    """A head node (no GPUs: it runs nothing of a mesh) and `workers` nodes with `gpus` logical GPUs each."""

    def __init__(self, workers: int, workdir: str, gpus: int = 2, cpus: int = 2):
        self.tag = f"{os.getpid() % 100000}"
        self.workdir = workdir
        self.gpus, self.cpus = gpus, cpus
        self.bridge = f"mrb{self.tag}"
        self.head = ("rayhead", HEAD_ADDRESS, f"mry{self.tag}h")
        self.workers = [(f"raynode{i}", f"198.18.2.{10 + i}", f"mry{self.tag}n{i}") for i in range(workers)]
        self.token_path = os.path.join(workdir, "auth_token")
        self._nodes: list[subprocess.Popen] = []
        self._made_links: list[str] = []
        self._made_netns: list[str] = []

    @property
    def address(self) -> str:
        """The address a Ray client connects to."""
        return f"ray://{HEAD_ADDRESS}:{CLIENT_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """What a client (the kernel) needs in its environment: token authentication, the token's file."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 90.0) -> RayTestCluster:
        """Network, the head, every worker; returns when the cluster counts every worker's GPUs."""
        os.makedirs(self.workdir, exist_ok=True)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        with open(os.path.join(self.workdir, "hosts"), "w") as f:  # each node's own /etc/hosts (a mount namespace)
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a, _ in [self.head, *self.workers]))
        os.chmod(self.workdir, 0o755)  # (ray's workers read it; the token file stays 0600)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _run("ip", "addr", "add", "198.18.2.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for _, address, netns in [self.head, *self.workers]:
            self._make_namespace(netns, address)
        self._start(self.head, ["--head", "--port=6379", "--include-dashboard=false",
                                f"--temp-dir={os.path.join(self.workdir, 'ray')}",
                                f"--ray-client-server-port={CLIENT_PORT}", "--num-gpus=0"])
        deadline = time.monotonic() + timeout
        self._wait(lambda: self.total_gpus() >= 0, deadline, "the head did not answer")  # (before it, workers time out)
        for node in self.workers:
            self._start(node, [f"--address={HEAD_ADDRESS}:6379", f"--num-gpus={self.gpus}"])
        self._wait(lambda: self.total_gpus() >= self.gpus * len(self.workers), deadline, "the workers did not join")
        return self

    def stop(self) -> None:
        """Kill every process of every node, remove the network and the files."""
        for netns in self._made_netns:
            for pid in self.pids(netns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._nodes:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for netns in self._made_netns:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for link in self._made_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------ inspection
    def pids(self, netns: str) -> list[int]:
        """Processes in a namespace."""
        done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def node_pids(self, index: int) -> list[int]:
        """Processes of worker node `index` (Ray's, and whatever runs there)."""
        return self.pids(self.workers[index][2])

    def state(self, what: str) -> str:
        """`ray list WHAT` (actors, placement-groups, nodes) as the head sees it."""
        return self.on_head([ray_command(), "list", what, "--limit", "1000"])

    def on_head(self, command: list[str]) -> str:
        """A command run on the head node; its stdout."""
        done = subprocess.run(["nsenter", f"--net=/run/netns/{self.head[2]}", *command], capture_output=True,
                              text=True, env={**os.environ, **self.env}, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} on the head failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def total_gpus(self) -> float:
        """GPUs the cluster counts (-1 while it cannot be asked)."""
        script = ("import ray, os; ray.init(address='auto', logging_level='ERROR'); "
                  "print(ray.cluster_resources().get('GPU', 0))")
        try:
            return float(self.on_head([sys.executable, "-c", script]).strip().splitlines()[-1])
        except (RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired):
            return -1.0

    # ------------------------------------------------------------ faults
    def fail_node(self, index: int) -> None:
        """A power loss: the node's link goes and every process on it (Ray's, the agent, the ranks) dies at once."""
        _run("ip", "link", "set", f"{self.workers[index][2]}v", "down")
        for pid in self.node_pids(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------ making it
    def _make_namespace(self, netns: str, address: str) -> None:
        veth = f"{netns}v"
        _run("ip", "netns", "add", netns)
        self._made_netns.append(netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
        self._made_links.append(veth)
        _run("ip", "link", "set", veth + "p", "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        # (no default route, as for the SSH hosts: a lookup that would leave the bridge fails at once; with
        # one, gloo's rendezvous waited on DNS timeouts)
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "link", "set", veth + "p", "name", "eth0"],
                    ["ip", "addr", "add", f"{address}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"]):
            _run("ip", "netns", "exec", netns, *cmd)

    def _start(self, who: tuple[str, str, str], args: list[str]) -> None:
        name, address, netns = who
        command = [ray_command(), "start", "--block", f"--node-ip-address={address}", f"--num-cpus={self.cpus}",
                   "--disable-usage-stats", "--object-store-memory=80000000", *args]
        hosts = os.path.join(self.workdir, "hosts")
        inner = f"hostname {name} && mount --bind {hosts} /etc/hosts && exec " + " ".join(command)
        log = open(os.path.join(self.workdir, f"{name}.out"), "ab")
        # the head's client proxy waits this long for the server it starts per client: Ray's 30 s is too
        # short on an oversubscribed 2-core machine (the tests also run with busy loops beside them)
        env = {**os.environ, **self.env, "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "180"}
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount",
                                 "sh", "-c", inner], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        self._nodes.append(proc)

    def _wait(self, predicate, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            if predicate():
                return
            for proc in self._nodes:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what}: a node's `ray start` exited ({proc.args}); see {self.workdir}")
            time.sleep(0.5)
        raise RuntimeError(f"{what} in time; see {self.workdir}")
