"""A real Ray cluster for tests: a head node and worker nodes, each `ray start` in a network namespace.

The head runs the GCS and Ray's client server (`ray://198.18.2.2:10001`); each worker joins it with
`ray start --address` and declares logical GPUs (`--num-gpus`), so placement groups, GPU bundles and
Ray's accelerator ids work on a CPU machine. The notebook's side (the kernel, in the root namespace)
reaches the cluster as a Ray client, as a laptop or a login node would. Token authentication is on
(`RAY_AUTH_MODE=token`, the token in a private file named by `RAY_AUTH_TOKEN_PATH`: never on a command
line). Addresses come from 198.18.2.0/24 (the SSH hosts use 198.18.0.0/24, Slurm 198.19.0.0/24); the namespaces
are `netlab`'s. `stop()` kills every process in them and removes them, also after a partial start.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import sys
import time

from netlab import BridgedNamespaces, kill_all, namespace_pids

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


def ray_command() -> str:
    """The `ray` launcher of this interpreter's environment."""
    return os.path.join(os.path.dirname(sys.executable), "ray")


class RayTestCluster:
    """A head node (no GPUs: it runs nothing of a mesh) and `workers` nodes with `gpus` logical GPUs each."""

    def __init__(self, workers: int, workdir: str, gpus: int = 2, cpus: int = 2):
        self.tag = f"{os.getpid() % 100000}"
        self.workdir = workdir
        self.gpus, self.cpus = gpus, cpus
        self.network = BridgedNamespaces(f"mrb{self.tag}", "198.18.2.1/24")
        self.head = ("rayhead", HEAD_ADDRESS, f"mry{self.tag}h")
        self.workers = [(f"raynode{i}", f"198.18.2.{10 + i}", f"mry{self.tag}n{i}") for i in range(workers)]
        self.token_path = os.path.join(workdir, "auth_token")
        self._nodes: list[subprocess.Popen] = []

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
        self.network.create()
        for _, address, netns in [self.head, *self.workers]:
            self.network.add(netns, address)
        self._start(self.head, ["--head", "--port=6379", "--include-dashboard=false",
                                f"--temp-dir={os.path.join(self.workdir, 'ray')}",
                                f"--ray-client-server-port={CLIENT_PORT}", "--num-gpus=0"])
        deadline = time.monotonic() + timeout
        self._wait(lambda: self.total_gpus() >= 0, deadline, "the head did not answer")  # (before it, workers time out)
        for node in self.workers:  # each node its own temp dir, as each host of a real cluster has its own /tmp
            # (sharing the head's, concurrent starts race for the same socket names and one `ray start` exits)
            self._start(node, [f"--address={HEAD_ADDRESS}:6379", f"--num-gpus={self.gpus}",
                               f"--temp-dir={os.path.join(self.workdir, 'ray-' + node[0])}"])
        self._wait(lambda: self.total_gpus() >= self.gpus * len(self.workers), deadline, "the workers did not join")
        return self

    def stop(self) -> None:
        """Kill every process of every node, remove the network and the files."""
        self.network.remove()
        for proc in self._nodes:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------ inspection
    def node_pids(self, index: int) -> list[int]:
        """Processes of worker node `index` (Ray's, and whatever runs there)."""
        return namespace_pids(self.workers[index][2])

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
        self.network.cut(self.workers[index][2])
        kill_all(self.node_pids(index))

    # ------------------------------------------------------------ making it
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
            for proc, name in zip(self._nodes, [self.head[0], *(n for n, _, _ in self.workers)]):
                if proc.poll() is not None:
                    raise RuntimeError(f"{what}: `ray start` on {name} exited ({proc.returncode}); it printed:\n"
                                       + self._log_tail(name))
            time.sleep(0.5)
        raise RuntimeError(f"{what} in time; the nodes printed:\n"
                           + "\n".join(self._log_tail(n) for n, _, _ in [self.head, *self.workers]))

    def client_server_logs(self, limit: int = 3000) -> str:
        """The tails of the head's client-server logs (the proxy's and each per-client server's errors)."""
        pattern = os.path.join(self.workdir, "ray", "session_latest", "logs", "ray_client_server*.err")
        parts = []
        for path in sorted(glob.glob(pattern)):
            with open(path, errors="replace") as f:
                parts.append(f"--- {os.path.basename(path)}\n" + f.read()[-limit:])
        return "\n".join(parts) or f"no client-server logs ({pattern})"

    def _log_tail(self, name: str, limit: int = 3000) -> str:
        try:
            with open(os.path.join(self.workdir, f"{name}.out"), errors="replace") as f:
                return f"--- {name}\n" + f.read()[-limit:]
        except OSError as error:
            return f"--- {name}: no output ({error})"
