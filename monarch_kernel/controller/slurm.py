"""Slurm allocations as meshes: submit (or attach to) a job, wait for it visibly, one agent per node.

The allocation is a batch job (`sbatch --parsable`) whose script only holds the nodes; each
node's host agent then runs as a job step of it (`srun --jobid ID --overlap -N1 -w NODE`) and
speaks the agent protocol on the step's stdin/stdout, so control traffic goes only through
Slurm's own authenticated step launch: nothing listens for agents. Only portable commands
are used (`sbatch --parsable`, `squeue -h -j ID -o ...`, `scontrol show hostnames|node`), as
they work the same on Slurm 22.05 and 24.11.

When the last agent step of a job we submitted ends (the mesh went down, or the kernel was
killed and took its `srun` clients along), the batch script sees it and ends the job, so no
allocation is left queued or running; `keep` leaves it for the next `--job` attach.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from monarch_kernel.controller.hostspec import HostKind, HostSpec
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.status import SHORT_TIME_NOTE


def poll_interval(waited: float) -> float:
    """How often to ask squeue while a job waits: briskly at first (most start within a second), then gently."""
    return 0.1 if waited < 3 else 0.5 if waited < 60 else 2.0

STEP_GRACE_S = 600  # a held job whose agents never came (the notebook died meanwhile) ends after this
HOLD_SCRIPT = """#!/bin/sh
# monarch_kernel: hold these nodes for a mesh's agents (job steps); end once they are all gone
# (the mesh went down, or the kernel died and its srun clients with it), or if none came
# (a restart closes the agents and starts new ones: allow it 10 s without steps)
me="$SLURM_JOB_ID"; seen=0; waited=0; idle=0
while :; do
  if squeue -h -s -j "$me" -o %i 2>/dev/null | grep -v -e '[.]batch$' -e '[.]extern$' | grep -q .; then
    seen=1; idle=0
  elif [ "$seen" = 1 ] && [ "$idle" -ge 10 ]; then
    exit 0
  elif [ "$waited" -ge {grace} ]; then
    exit 0
  else
    idle=$((idle + 2))
  fi
  sleep 2; waited=$((waited + 2))
done
"""
KEEP_SCRIPT = "#!/bin/sh\n# monarch_kernel: hold these nodes until the job's time ends or scancel\nexec sleep infinity\n"


@dataclass(frozen=True)
class SlurmRequest:
    """What to ask Slurm for (or which job to attach to)."""

    nodes: int = 1
    gpus: int = 1  # ranks per node (and GPUs requested per node, if request_gpus)
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    sbatch_args: tuple[str, ...] = ()
    request_gpus: bool = True
    job: str | None = None  # attach to this allocation instead of submitting one
    reuse: bool = False  # attach to the newest running monarch-kernel job of this user (by its name)
    name: str = "mesh"
    keep: bool = False
    wait_timeout: float | None = None

    def sbatch_command(self, script: str) -> list[str]:
        """The sbatch command line (everything but the script's text, which goes on stdin)."""
        cmd = ["sbatch", "--parsable", f"--job-name=monarch-{self.name}", f"--nodes={self.nodes}",
               "--ntasks-per-node=1", "--output=/dev/null", "--error=/dev/null"]
        for flag, value in (("--partition", self.partition), ("--time", self.time), ("--account", self.account),
                            ("--qos", self.qos), ("--constraint", self.constraint)):
            if value:
                cmd.append(f"{flag}={value}")
        if self.request_gpus:
            cmd.append(f"--gpus-per-node={self.gpus}")
        return [*cmd, *self.sbatch_args]


@dataclass
class SlurmJob:
    """An allocation a mesh runs in: its id, nodes and their addresses."""

    job_id: str
    nodes: list[str]
    addresses: dict[str, str]
    owned: bool  # we submitted it (so `down` ends it unless keep)
    keep: bool = False
    request: SlurmRequest | None = None  # what to ask for again if it ends (jobs we submitted)
    python: str = "python3"  # the nodes' interpreter and set-up line, for their agents
    setup: str | None = None
    direct: bool = True  # agents offer an authenticated direct link (else all traffic rides srun's stdio)
    _last_status: tuple[float, str] = (float("-inf"), "")
    abandoned: threading.Event = dataclasses.field(default_factory=threading.Event)  # a renewal to give up

    def host_specs(self) -> tuple[HostSpec, ...]:
        """One host per node, its agent a step of this job."""
        return tuple(HostSpec(node, HostKind.SLURM, target=node, python=self.python, setup=self.setup,
                              options={"job": self.job_id, "address": self.addresses[node], "direct": self.direct})
                     for node in self.nodes)

    def renew(self) -> tuple[HostSpec, ...]:
        """Hosts for a restart: this job's nodes while it runs, else those of a new allocation."""
        state, reason, _ = job_state(self.job_id)
        if state == "RUNNING":
            return self.host_specs()
        if not self.owned or self.request is None:
            raise MeshStartError(f"Slurm job {self.job_id}, which this mesh attached to, is {state or 'gone'}"
                                 f"{f' ({reason})' if reason not in ('', 'None') else ''}; start a new mesh "
                                 "(%mesh up slurm ...) or attach to a running job")
        self.abandoned.clear()
        fresh = allocate(self.request, _print, on_submitted=self._submitted, stop=self.abandoned.is_set)
        self.job_id, self.nodes, self.addresses = fresh.job_id, fresh.nodes, fresh.addresses
        self._last_status = (float("-inf"), "")
        return self.host_specs()

    def _submitted(self, job_id: str) -> None:
        self.job_id = job_id  # at once: a `down` while it is queued cancels this one, not the old one

    def abandon(self) -> None:
        """A restart waiting for a new allocation was interrupted or timed out: stop waiting (its job is cancelled)."""
        self.abandoned.set()

    def release(self) -> None:
        """End the allocation if this mesh made it and was not asked to keep it."""
        self.abandoned.set()
        if self.owned and not self.keep:
            cancel(self.job_id)

    def status_line(self, max_age_s: float = 0.0) -> str:
        """`Slurm job 12: RUNNING on node[0-1], 1:58:02 left`, with a warning under 10 minutes."""
        asked, line = self._last_status
        if time.monotonic() - asked <= max_age_s:
            return line
        line = self._ask_status()
        self._last_status = (time.monotonic(), line)
        return line

    def _ask_status(self) -> str:
        try:
            done = _slurm("squeue", "-h", "-j", self.job_id, "-o", "%T|%r|%N|%L")
        except (MeshStartError, subprocess.TimeoutExpired, OSError) as exc:
            return f"Slurm job {self.job_id}: state unknown ({exc})"
        fields = (done.stdout.strip().splitlines() or [""])[-1].split("|")
        if len(fields) < 4:
            return f"Slurm job {self.job_id}: no longer known to Slurm (it ended)"
        state, reason, nodes, left = fields[:4]
        line = f"Slurm job {self.job_id}: {state}" + (f" ({reason})" if reason not in ("", "None") else "")
        line += f" on {nodes}, {left} left" + ("" if self.owned else " (attached: down leaves it running)")
        seconds = time_left_seconds(left)
        if seconds is not None and seconds < 600:
            line += f" -- {SHORT_TIME_NOTE}: checkpoint now, or ask for a longer --time"
        return line


def time_left_seconds(text: str) -> int | None:
    """squeue's %L (`1-02:03:04`, `2:03:04`, `3:04`, `UNLIMITED`) in seconds (None: no limit or unknown)."""
    days, _, rest = text.rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def _print(text: str) -> None:
    print(text, end="", flush=True)


def _slurm(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    if shutil.which(args[0]) is None:
        raise MeshStartError(f"{args[0]} is not on PATH: is this machine a Slurm login node? "
                             "(install the Slurm client tools, or load the cluster's slurm module)")
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def submit(request: SlurmRequest) -> str:
    """Submit the holding job; its id. A request Slurm refuses raises MeshStartError with Slurm's words."""
    script = KEEP_SCRIPT if request.keep else HOLD_SCRIPT.format(grace=STEP_GRACE_S)
    done = subprocess.run(request.sbatch_command(script), input=script, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        said = done.stderr.strip().removeprefix("sbatch: error: ")
        raise MeshStartError(f"Slurm refused the allocation: {said}\n{_hint(said, request)}")
    return done.stdout.strip().split(";")[0]


def _hint(said: str, request: SlurmRequest) -> str:
    low = said.lower()
    if "account" in low or "association" in low:
        return "hint: `sacctmgr show assoc user=$USER` lists your accounts; pass --account"
    if "time limit" in low:
        return "hint: `sinfo -o '%P %l'` shows each partition's time limit; pass a shorter --time"
    if "gres" in low or "gpu" in low:
        return ("hint: these nodes may have no GPUs as Slurm counts them (gres): ask for a GPU partition, or run "
                "on CPUs without a GPU request (request_gpus=False, `%mesh up slurm --no-gpu-request`)")
    if "node count" in low or "nodes" in low or "configuration is not available" in low:
        return (f"hint: {request.nodes} nodes with {request.gpus} GPUs each may be more than the partition has; "
                "`sinfo -N -l` shows its nodes (on CPU-only nodes, do not request GPUs)")
    if "partition" in low:
        return "hint: `sinfo -s` lists the partitions you may use; pass --partition"
    return "hint: try the same request with `sbatch --test-only` to see what Slurm thinks of it"


def partition_gres(partition: str | None) -> list[str] | None:
    """The generic resources (`gpu:a100:8(S:0-1)`, `(null)`) of the partition's nodes (the default
    partition if None); None if Slurm could not say."""
    try:
        done = _slurm("sinfo", "-h", "-o", "%P|%G", timeout=15)
    except (MeshStartError, subprocess.TimeoutExpired, OSError):
        return None
    if done.returncode != 0:
        return None
    found = []
    for line in done.stdout.splitlines():
        name, _, gres = line.strip().partition("|")
        default = name.endswith("*")
        if (partition is None and default) or name.rstrip("*") == partition:
            found.append(gres)
    return found or None


def _gpus_in(gres: list[str] | None) -> bool:
    """Whether any node of a partition has GPUs (True when Slurm could not say: ask as asked)."""
    return gres is None or any("gpu" in g.lower() for g in gres)


def without_gpus(request: SlurmRequest, report: Callable[[str], None]) -> SlurmRequest:
    """The request, without its GPU request if the partition's nodes have none (said in one line):
    `gpus=N` means N ranks per node, on CPU nodes too, as on a local mesh."""
    if not request.request_gpus or _gpus_in(partition_gres(request.partition)):
        return request
    where = f"partition {request.partition}" if request.partition else "the default partition"
    report(f"Slurm: {where} has no GPUs (no gpu gres on its nodes): asking for {request.nodes} node"
           f"{'s' * (request.nodes != 1)} without a GPU request; {request.gpus} rank{'s' * (request.gpus != 1)} "
           "per node run on CPUs (pass a GPU partition to get GPUs)\n")
    return dataclasses.replace(request, request_gpus=False)


def cancel(job_id: str) -> None:
    """scancel, ignoring a job that is already gone."""
    try:
        _slurm("scancel", job_id, timeout=30)
    except (MeshStartError, subprocess.TimeoutExpired):
        pass


def job_state(job_id: str) -> tuple[str, str, str]:
    """(state, reason, node list) of a job; state "" when Slurm no longer knows it."""
    done = _slurm("squeue", "-h", "-j", job_id, "-o", "%T|%r|%N")
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    state, reason, nodes = (line.split("|") + ["", "", ""])[:3]
    return state, reason, nodes


def wait_running(job_id: str, *, timeout: float | None, report: Callable[[str], None],
                 stop: Callable[[], bool] | None = None) -> str:
    """Until the job runs; its node list. Reports each change of state (KeyboardInterrupt passes through;
    `stop()` turning true, e.g. an abandoned restart, raises MeshStartError)."""
    start, last = time.monotonic(), None
    while True:
        if stop is not None and stop():
            raise MeshStartError(f"the wait for Slurm job {job_id} was abandoned")
        state, reason, nodes = job_state(job_id)
        waited = time.monotonic() - start
        if state == "RUNNING":
            done = f"Slurm job {job_id}: RUNNING on {nodes} after {waited:.0f} s"
            report("\r" + done.ljust(len(last or "")) + "\n")
            return nodes
        if state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                     "DEADLINE", "OUT_OF_MEMORY"):
            raise MeshStartError(f"Slurm job {job_id} ended before it ran ({state or 'gone'}"
                                 f"{', ' + reason if reason and reason != 'None' else ''})")
        why = f" ({reason})" if reason and reason != "None" else ""
        line = f"Slurm job {job_id}: {state}{why}, waited {waited:.0f} s (the stop button cancels it)"
        if line != last:
            report("\r" + line)
            last = line
        if timeout is not None and waited > timeout:
            raise TimeoutError(f"Slurm job {job_id} was still {state}{why} after {timeout:g} s")
        time.sleep(poll_interval(waited))


def node_names(nodelist: str) -> list[str]:
    """`node[0-3]` as node names, by Slurm's own rules."""
    return _slurm("scontrol", "show", "hostnames", nodelist).stdout.split()


def node_addresses(nodelist: str, nodes: list[str]) -> dict[str, str]:
    """Each node's address as Slurm (and so the other nodes) reach it: one scontrol call for all."""
    found: dict[str, str] = {}
    name = None
    for word in _slurm("scontrol", "-o", "show", "node", nodelist).stdout.split():
        if word.startswith("NodeName="):
            name = word.split("=", 1)[1]
        elif word.startswith("NodeAddr=") and name is not None:
            found[name] = word.split("=", 1)[1]
    return {node: found.get(node, node) for node in nodes}


def node_state(node: str) -> str:
    """Slurm's state of a node, with its reason if it has one (`down* (Not responding)`)."""
    try:
        line = _slurm("sinfo", "-h", "-N", "-n", node, "-o", "%T|%E", timeout=10).stdout.strip().splitlines()
    except (MeshStartError, subprocess.TimeoutExpired, OSError):
        return "unknown"
    state, _, reason = (line[0] if line else "unknown|").partition("|")
    return state + (f" ({reason})" if reason and reason != "none" else "")


def find_reusable(name: str | None) -> str:
    """The newest running job of this user that a mesh made (`monarch-NAME`, any mesh's if name is None)."""
    import getpass

    listed = _slurm("squeue", "-h", "-u", getpass.getuser(), "-t", "RUNNING", "-o", "%i|%j").stdout.split()
    jobs = [line.split("|", 1) for line in listed if "|" in line]
    wanted = [job for job, job_name in jobs
              if job_name == f"monarch-{name}" or (name is None and job_name.startswith("monarch-"))
              and not job_name.startswith("monarch-agent-")]
    if not wanted:
        raise MeshStartError(f"no running Slurm job of yours is named monarch-{name or '*'}; start one with "
                             "%mesh up slurm ... --keep, or name the job with --job ID")
    return max(wanted, key=lambda job: int(job.split("_")[0]) if job.split("_")[0].isdigit() else 0)


def attach(request: SlurmRequest, reuse_name: str | None = None) -> SlurmJob:
    """The running allocation `request.job` (not ours: `down` leaves it running)."""
    if request.reuse:
        request = SlurmRequest(**{**request.__dict__, "job": find_reusable(reuse_name)})
    assert request.job is not None
    state, reason, nodelist = job_state(request.job)
    if state != "RUNNING":
        raise MeshStartError(f"Slurm job {request.job} is {state or 'not known to Slurm'}"
                             f"{f' ({reason})' if reason and reason != 'None' else ''}; attach to a running job")
    nodes = node_names(nodelist)
    return SlurmJob(request.job, nodes, node_addresses(nodelist, nodes), owned=False)


def allocate(request: SlurmRequest, report: Callable[[str], None], *,
             on_submitted: Callable[[str], None] | None = None, stop: Callable[[], bool] | None = None) -> SlurmJob:
    """Submit, wait until running (visibly), and describe the nodes; cancels on interrupt, timeout or stop().

    on_submitted(job id) runs as soon as Slurm took the job, so a `down` meanwhile cancels it.
    A GPU request on a partition whose nodes have no GPUs is dropped, in one line (see `without_gpus`).
    """
    request = without_gpus(request, report)
    job_id = submit(request)
    if on_submitted is not None:
        on_submitted(job_id)
    try:
        nodelist = wait_running(job_id, timeout=request.wait_timeout, report=report, stop=stop)
        nodes = node_names(nodelist)
        return SlurmJob(job_id, nodes, node_addresses(nodelist, nodes), owned=True, keep=request.keep,
                        request=request)
    except BaseException as exc:
        cancel(job_id)  # nothing stays queued
        if isinstance(exc, TimeoutError):
            raise MeshStartError(f"{exc}; the request was cancelled (scancel {job_id}). Ask for fewer or "
                                 "smaller nodes, another partition, or a longer --wait-timeout") from None
        raise


# ---------------------------------------------------------------- one node's agent


def describe(job: SlurmJob) -> str:
    """One line for logs and status."""
    return f"Slurm job {job.job_id} on {' '.join(shlex.quote(n) for n in job.nodes)}"
