"""A real Slurm cluster for tests: slurmctld and one slurmd per node, each in a network namespace.

Debian's slurmctld, slurmd and munge (22.05). Addresses come from 198.19.0.0/24 (the SSH
test hosts use 198.18.0.0/24). Nothing is written to /etc: the configuration lives in a
private folder selected with SLURM_CONF, one munged serves every node over a private
socket, and each daemon runs in its own UTS and mount namespace so that it has its own
host name and hosts file. `stop()` tears everything down and is safe after a partial start.
See ../shared/SLURM-LAB.md for why each step is as it is.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from mungelab import PrivateMunged
from mungelab import unavailable_reason as munge_unavailable
from netlab import BridgedNamespaces, kill_all, namespace_pids

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch")


def unavailable_reason() -> str | None:
    """Why the cluster cannot be made here (None when it can)."""
    if os.geteuid() != 0:
        return "a Slurm test cluster needs root (namespaces, daemons)"
    for tool in (*DAEMONS, "/usr/bin/nsenter", "/usr/bin/unshare"):
        if not os.path.exists(tool):
            return f"{tool} is missing (apt-get install slurmctld slurmd slurm-client munge)"
    return munge_unavailable()


class SlurmTestCluster:
    """A controller and `count` compute nodes (node0, node1, ...), 2 CPUs each."""

    def __init__(self, count: int, workdir: str, cpus: int = 2):
        self.tag = f"{os.getpid() % 100000}"
        self.workdir = workdir
        self.cpus = cpus
        self.network = BridgedNamespaces(f"msb{self.tag}", "198.19.0.1/24")
        self.controller = ("ctl", "198.19.0.2", f"msl{self.tag}c")
        self.nodes = [(f"node{i}", f"198.19.0.{10 + i}", f"msl{self.tag}n{i}") for i in range(count)]
        self.conf = os.path.join(workdir, "slurm.conf")
        self.munge_socket = os.path.join(workdir, "munge", "munge.sock")
        self._daemons: list[subprocess.Popen] = []
        self._munged: PrivateMunged | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, srun, the mesh) needs in its environment."""
        return {"SLURM_CONF": self.conf}

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 30.0) -> SlurmTestCluster:
        """Network, munge, slurmctld and every slurmd; returns when every node is idle."""
        self.network.create()
        for _, address, netns in [self.controller, *self.nodes]:
            self.network.add(netns, address)
        self._write_files()
        self._start_munge()
        self._start(self.controller, ["/usr/sbin/slurmctld", "-D", "-f", self.conf])
        self._wait(lambda: self._sinfo_ok(), timeout, "slurmctld did not answer")
        for node in self.nodes:
            self._start(node, ["/usr/sbin/slurmd", "-D", "-N", node[0], "-f", self.conf])
        self._wait(self.all_idle, timeout, "the nodes did not become idle")
        return self

    def stop(self) -> None:
        """Stop every daemon and whatever is left in the nodes, remove the network and files."""
        if self._munged is not None:
            self._munged.stop()
        for proc in self._daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self._daemons:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.network.remove()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------ inspection
    def pids(self, netns: str) -> list[int]:
        """Processes in a namespace."""
        return namespace_pids(netns)

    def node_pids(self, index: int) -> list[int]:
        """Processes of a compute node (its slurmd, and whatever runs there)."""
        return namespace_pids(self.nodes[index][2])

    def squeue(self) -> str:
        """Jobs in the queue, as `squeue -h -o '%i %T %r %N'` shows them."""
        return subprocess.run(["squeue", "-h", "-o", "%i %T %r %N"], capture_output=True, text=True,
                              env={**os.environ, **self.env}).stdout

    # ------------------------------------------------------------ faults
    def veth(self, index: int) -> str:
        """The bridge's end of a node's link."""
        return self.network.veth(self.nodes[index][2])

    def cut_link(self, index: int) -> None:
        """The node drops off the network (its processes keep running)."""
        self.network.cut(self.nodes[index][2])

    def fail_node(self, index: int) -> None:
        """A power loss: the node's link goes and every process on it (slurmd, steps, ours) dies at once."""
        self.cut_link(index)
        kill_all(self.node_pids(index))

    # ------------------------------------------------------------ making it
    def _write_files(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a, _ in [self.controller, *self.nodes])
        with open(os.path.join(self.workdir, "hosts"), "w") as f:
            f.write(hosts)
        state = os.path.join(self.workdir, "state")
        os.makedirs(state, exist_ok=True)
        os.makedirs(os.path.join(self.workdir, "spool"), exist_ok=True)  # slurmd makes spool/<node> itself
        name, address, _ = self.controller
        nodes = "".join(f"NodeName={n} NodeAddr={a}\n" for n, a, _ in self.nodes)
        names = ",".join(n for n, _, _ in self.nodes)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=monarchlab
SlurmctldHost={name}({address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
EnforcePartLimits=ALL
MinJobAge=10
KillWait=5
InactiveLimit=0
MailProg=/bin/true
SchedulerType=sched/backfill
StateSaveLocation={state}
SlurmdSpoolDir={self.workdir}/spool/%n
SlurmctldPidFile={self.workdir}/slurmctld.pid
SlurmdPidFile={self.workdir}/slurmd-%n.pid
SlurmctldLogFile={self.workdir}/slurmctld.log
SlurmdLogFile={self.workdir}/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=DEFAULT CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
{nodes}PartitionName=lab Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes={names} MaxTime=INFINITE State=UP PriorityTier=10
""")

    def _start_munge(self) -> None:
        os.chmod(self.workdir, 0o755)  # munge must reach its folder inside ours
        self._munged = PrivateMunged(os.path.dirname(self.munge_socket)).start()

    def _start(self, who: tuple[str, str, str], command: list[str]) -> None:
        name, _, netns = who
        hosts = os.path.join(self.workdir, "hosts")
        inner = f"hostname {name} && mount --bind {hosts} /etc/hosts && exec " + " ".join(command)
        log = open(os.path.join(self.workdir, f"{name}.out"), "ab")
        # nsenter (not `ip netns exec`, which remounts /sys and hides the cgroup tree from slurmd)
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount",
                                 "sh", "-c", inner], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env={**os.environ, **self.env})
        self._daemons.append(proc)

    def _sinfo_ok(self) -> bool:
        done = subprocess.run(["sinfo", "-h"], capture_output=True, env={**os.environ, **self.env})
        return done.returncode == 0

    def all_idle(self) -> bool:
        """Every node is idle (no job, nor one still completing)."""
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                              env={**os.environ, **self.env})
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what}: a daemon exited ({proc.args}); see {self.workdir}")
            time.sleep(0.05)
        raise RuntimeError(f"{what} within {timeout:.0f} s; see {self.workdir}")
