"""What a Monarch program imports from `monarch.job` to get hosts: `ProcessJob` (hosts on this machine) and
`LoginJob` (hosts whose workers the job starts, then attaches to).

>>> from monarch_kernel.monarch.job import ProcessJob
>>> job = ProcessJob({"trainers": 2, "dataloaders": 1})
>>> state = job.state(cached_path=None)
>>> procs = state.trainers.spawn_procs(per_host={"gpus": 4})   # {hosts: 2, gpus: 4}
>>> job.kill()

Each host of a ProcessJob runs its own host agent on this machine, as a separate machine's would, so
a program written for several hosts runs here unchanged. Jobs run from the notebook. For SSH hosts
and Slurm allocations use `%mesh up ssh|slurm` (or `monarch_kernel.ssh_mesh`, `slurm_mesh`) and
`mesh.host_mesh()`: Monarch's `SlurmJob` and batch-mode scripts are not provided. A `LoginJob` subclass
starts each host's worker in `_start_host` (`run_worker_loop_forever`, see agent/worker.py). `PortForwarder`
(TCP forwards between process meshes) is `monarch_kernel.monarch.port_forward`'s.
"""

from __future__ import annotations

import abc
import contextlib
import os
import signal
from typing import Any, NamedTuple

from monarch_kernel.actors.procs import HostMesh
from monarch_kernel.monarch.port_forward import PortForwarder


class JobState:
    """A job's host meshes, by the names it was given: `state.trainers`."""

    def __init__(self, hosts: dict[str, HostMesh]):
        self._hosts = hosts

    def __getattr__(self, name: str) -> HostMesh:
        hosts = self.__dict__.get("_hosts", {})
        if name not in hosts:
            raise AttributeError(f"the job has no host mesh {name!r} (it has: {', '.join(sorted(hosts)) or 'none'})")
        return hosts[name]

    def __repr__(self) -> str:
        return f"<JobState {', '.join(f'{k}: {len(v.shape.ranks)} hosts' for k, v in self._hosts.items())}>"


class JobTrait(abc.ABC):
    """What every job offers: `state()` (its host meshes) and `kill()`."""

    def __init__(self) -> None:
        self._hosts: dict[str, HostMesh] | None = None  # the job's hosts, made by the first state()
        self._states: list[JobState] = []  # every state() given out (kill() stops what each started)

    def state(self, cached_path: str | None = None) -> JobState:
        """The job's host meshes: each call gives new HostMesh objects on the same hosts, as a new client of
        Monarch's connects anew (so one's `stop()` ends only the processes it started). `cached_path` is
        Monarch's on-disk cache, which a notebook kernel has no use for: the job lives as long as the kernel."""
        if self._hosts is None:
            self._hosts = self._create()
        state = JobState({name: hosts.attached() for name, hosts in self._hosts.items()})
        self._states.append(state)
        return state

    def apply(self) -> None:
        """Make the job's hosts now (Monarch's: start the job); `state()` does it on first use otherwise."""
        if self._hosts is None:
            self._hosts = self._create()

    @abc.abstractmethod
    def _create(self) -> dict[str, HostMesh]:
        """The job's host meshes, by name (made once)."""

    def kill(self) -> None:
        """Stop every process started on the job's hosts; a later `state()` makes new hosts."""
        for state in self._states:
            for hosts in state._hosts.values():
                with contextlib.suppress(RuntimeError):  # (a program may have shut them down itself)
                    hosts.shutdown()
        self._states.clear()
        self._hosts = None


class ProcessJob(JobTrait):
    """Hosts on this machine: {name: number of hosts}, each host with its own agent (see the module's note)."""

    def __init__(self, meshes: dict[str, int], env: dict[str, str] | None = None) -> None:
        super().__init__()
        self._meshes = dict(meshes)
        self._env = dict(env or {})

    def _create(self) -> dict[str, HostMesh]:
        from monarch_kernel.api.this_host import local_hosts  # noqa: PLC0415 - notebook side only

        return {name: local_hosts(count, name, self._env) for name, count in self._meshes.items()}

    def __repr__(self) -> str:
        return f"ProcessJob({self._meshes!r})"


class ProcessState(NamedTuple):
    """A worker a LoginJob started: its pid and the address it waits at."""

    pid: int
    channel: str


class LoginJob(JobTrait):
    """Hosts whose workers the job starts itself (`_start_host`, e.g. over a login shell), then attaches to
    (`attach_to_workers`), as Monarch's: `add_mesh(name, hosts)` names them."""

    def __init__(self) -> None:
        super().__init__()
        self._meshes: dict[str, list[str]] = {}
        self._host_to_pid: dict[str, ProcessState] = {}

    def add_mesh(self, name: str, hosts: list[str]) -> None:
        """A host mesh `name` of these hosts (one worker each)."""
        self._meshes[name] = list(hosts)

    @abc.abstractmethod
    def _start_host(self, host: str) -> ProcessState:
        """Start `host`'s worker (`run_worker_loop_forever`); its pid and address."""

    def _create(self) -> dict[str, HostMesh]:
        from monarch_kernel.api.workers import attach_to_workers  # noqa: PLC0415 - notebook side only

        for hosts in self._meshes.values():
            for host in hosts:
                if host not in self._host_to_pid:
                    self._host_to_pid[host] = self._start_host(host)
        return {name: attach_to_workers([self._host_to_pid[h].channel for h in hosts], name)
                for name, hosts in self._meshes.items()}

    def kill(self) -> None:
        """Shut the hosts down (their workers end), then make sure every worker the job started is gone."""
        super().kill()
        for state in self._host_to_pid.values():
            with contextlib.suppress(OSError):
                os.kill(state.pid, signal.SIGKILL)
        self._host_to_pid.clear()


__all__ = ["JobState", "JobTrait", "LoginJob", "PortForwarder", "ProcessJob", "ProcessState"]


def __getattr__(name: str) -> Any:
    if name in ("SlurmJob", "LocalJob"):
        raise AttributeError(f"monarch_kernel.monarch.job has no {name}: start SSH or Slurm meshes with %mesh up "
                             "(or monarch_kernel.ssh_mesh / slurm_mesh) and use mesh.host_mesh()")
    raise AttributeError(name)
