"""Monarch's host and process meshes (`monarch_kernel.monarch`): who may stop what, a job's clients,
pinning processes to CPUs, a bootstrap that fails, and the hooks Monarch programs use around spawns."""

import os
import sys
import threading
from pathlib import Path
from unittest.mock import patch

import cloudpickle
import pytest
from conftest import wait_until

from monarch_kernel.core.errors import MeshStartError, MeshUsageError
from monarch_kernel.monarch.actor import (
    Actor,
    ActorError,
    BootstrapCommand,
    _client_context,
    context,
    default_bootstrap_cmd,
    endpoint,
    register_proc_mesh_spawn_callback,
    this_host,
    unregister_proc_mesh_spawn_callback,
)
from monarch_kernel.monarch.job import ProcessJob

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file
NODE0 = Path("/sys/devices/system/node/node0")


class Probe(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def variable(self, name: str) -> str:
        return os.environ.get(name, "")

    @endpoint
    def affinity_of_every_thread(self) -> list[list[int]]:
        return sorted({tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir("/proc/self/task")})


def _running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _pids(procs, name: str) -> list[int]:
    return sorted(procs.spawn(name, Probe).pid.call().get().values())


# ------------------------------------------------------------------ pinning (proc_bind)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin two processes apart")
@pytest.mark.timeout(120)
def test_proc_bind_pins_every_thread_of_each_process_to_its_own_cpus():
    first, second = sorted(os.sched_getaffinity(0))[:2]
    procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none",
                                    proc_bind=[{"cpus": str(first)}, {"cpus": str(second)}])
    try:
        pinned = procs.spawn("pinned", Probe).affinity_of_every_thread.call().get()
        assert [value for _, value in pinned.items()] == [[(first,)], [(second,)]]
    finally:
        procs.stop()


@pytest.mark.skipif(not NODE0.exists(), reason="this host shows no NUMA nodes")
@pytest.mark.timeout(120)
def test_proc_bind_cpunodebind_pins_to_the_cpus_of_that_numa_node():
    node_cpus = set()
    for part in (NODE0 / "cpulist").read_text().strip().split(","):
        low, _, high = part.partition("-")
        node_cpus.update(range(int(low), int(high or low) + 1))
    procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none", proc_bind=[{"cpunodebind": "0"}])
    try:
        (affinities,) = [value for _, value in procs.spawn("node", Probe).affinity_of_every_thread.call().get().items()]
        assert affinities and all(set(cpus) <= node_cpus for cpus in affinities)
    finally:
        procs.stop()


@pytest.mark.timeout(120)
def test_a_proc_bind_that_cannot_be_applied_says_why_and_starts_nothing():
    with pytest.raises(ValueError, match=r"proc_bind length \(1\) must equal procs_per_host \(4\)"):
        this_host().spawn_procs(per_host={"gpus": 4}, proc_bind=[{"cpunodebind": "0"}])
    with pytest.raises(ValueError, match=r"not binding keys; use cpunodebind, membind, physcpubind, cpus"):
        this_host().spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cores": "0"}])
    with pytest.raises(ValueError, match="not a list of numbers"):
        this_host().spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpus": "first"}])
    missing = max(os.sched_getaffinity(0)) + 4096
    with pytest.raises(MeshStartError, match=rf"cannot pin to CPUs \[{missing}\].*this host has CPUs"):
        this_host().spawn_procs(per_host={"gpus": 1}, dist="none", proc_bind=[{"cpus": str(missing)}])


# ------------------------------------------------------------------ bootstrap, spawn hooks, context


def _values(procs, name: str, variable: str) -> list[str]:
    return [value for _, value in procs.spawn(name, Probe).variable.call(variable).get().items()]


@pytest.mark.timeout(180)
def test_bootstrap_command_sets_each_process_environment_and_its_program_runs_the_hosts(tmp_path):
    base = default_bootstrap_cmd()
    started = []
    try:
        started.append(this_host().spawn_procs(per_host={"gpus": 1}, dist="none",
                                               bootstrap_command=base.with_env({"CUDA_VISIBLE_DEVICES": "3"})))
        assert _values(started[-1], "uniform", "CUDA_VISIBLE_DEVICES") == ["3"]
        started.append(this_host().spawn_procs(
            per_host={"gpus": 2}, dist="none",
            bootstrap_command=lambda point: base.with_env({"CUDA_VISIBLE_DEVICES": str(point["gpus"])})))
        assert _values(started[-1], "per_point", "CUDA_VISIBLE_DEVICES") == ["0", "1"]
        assert base.env == {}  # with_env made new commands
        started.append(this_host().spawn_procs(per_host={"gpus": 1}, dist="none"))
        assert _values(started[-1], "plain", "CUDA_VISIBLE_DEVICES") == [os.environ.get("CUDA_VISIBLE_DEVICES", "")]

        wrapper = tmp_path / "python-wrapper"
        wrapper.write_text(f'#!/bin/sh\nexport WRAPPED_BY=$$\nexec {sys.executable} "$@"\n')
        wrapper.chmod(0o700)
        started.append(this_host().spawn_procs(per_host={"gpus": 1}, dist="none",
                                               bootstrap_command=BootstrapCommand(str(wrapper))))
        assert _values(started[-1], "wrapped", "WRAPPED_BY")[0].isdigit()  # the hosts' agent ran the program
    finally:
        for procs in started:
            procs.stop()
    with pytest.raises(MeshUsageError, match="leave arg0 and args out"):
        this_host().spawn_procs(bootstrap_command=BootstrapCommand(sys.executable, None, ["-c", "pass"]))
    with pytest.raises(MeshUsageError, match="one program per spawn_procs"):
        this_host().spawn_procs(per_host={"gpus": 2},
                                bootstrap_command=lambda point: BootstrapCommand(f"python3.{point['gpus']}"))


def _failing_bootstrap() -> None:
    raise RuntimeError("the bootstrap found no dataset")


@pytest.mark.timeout(120)
def test_a_failing_bootstrap_stops_the_processes_and_initialized_and_spawn_raise_it(capfd):
    procs = this_host().spawn_procs(per_host={"gpus": 2}, dist="none", bootstrap=_failing_bootstrap)
    assert "initialized` and spawn on them raise why" in capfd.readouterr().err  # said at once, too
    with pytest.raises(ActorError, match="the bootstrap found no dataset"):
        procs.initialized.get()
    with pytest.raises(ActorError, match="the bootstrap found no dataset"):
        procs.slice(gpus=0).spawn("never", Probe)
    procs.stop()  # (nothing left to stop; no error)


@pytest.mark.timeout(120)
def test_spawn_callbacks_see_each_proc_mesh_before_spawn_procs_returns_until_unregistered():
    seen_first, seen_second = [], []
    register_proc_mesh_spawn_callback(seen_first.append)
    register_proc_mesh_spawn_callback(seen_second.append)
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none")
        assert seen_first == [procs] and seen_second == [procs] and seen_first[0] is procs
        procs.stop()
    finally:
        unregister_proc_mesh_spawn_callback(seen_first.append)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, dist="none")
    procs.stop()
    assert len(seen_first) == 1 and len(seen_second) == 2
    unregister_proc_mesh_spawn_callback(seen_second.append)
    with pytest.raises(ValueError):
        unregister_proc_mesh_spawn_callback(seen_second.append)


def test_context_outside_actors_is_the_root_client_made_at_each_ask_not_kept_per_thread():
    names = []
    with patch.object(_client_context, "get", side_effect=_client_context.get) as asked:
        threads = [threading.Thread(target=lambda: names.append(context().actor_instance.actor_id))
                   for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert asked.call_count == 20 and set(names) == {"root"}


# ------------------------------------------------------------------ who stops what


@pytest.mark.timeout(240)
def test_each_job_client_stops_only_its_own_processes_and_references_cannot_stop_hosts():
    job = ProcessJob({"hosts": 2})
    try:
        first = job.state(cached_path=None).hosts
        second = job.state(cached_path=None).hosts
        assert first is not second and first.extent == second.extent == {"hosts": 2}
        with pytest.raises(RuntimeError, match="cannot shut down `HostMesh` that is a reference instead of owned"):
            first.slice(hosts=1).shutdown()
        with pytest.raises(RuntimeError, match="reference instead of owned"):
            cloudpickle.loads(cloudpickle.dumps(first)).stop()

        mine = _pids(first.spawn_procs(per_host={"gpus": 1}, dist="none"), "mine")
        theirs = _pids(second.spawn_procs(per_host={"gpus": 1}, dist="none"), "theirs")
        assert first.stop().get() is None
        assert wait_until(lambda: not any(_running(pid) for pid in mine), timeout=30), "the first client's processes end"
        assert all(_running(pid) for pid in theirs)  # another client's, on the same hosts, go on
        again = _pids(first.spawn_procs(per_host={"gpus": 1}, dist="none"), "again")  # stop() keeps the hosts

        assert second.shutdown().get() is None
        assert wait_until(lambda: not any(_running(pid) for pid in theirs), timeout=30), "the second client's end"
        assert all(_running(pid) for pid in again)
        assert second._inner_host_mesh is None and first._inner_host_mesh is not None
        with pytest.raises(RuntimeError, match="HostMesh has already been shut down"):
            second.spawn_procs(per_host={"gpus": 1})
        with pytest.raises(RuntimeError, match="HostMesh has already been shut down"):
            second.shutdown()
    finally:
        job.kill()
    assert wait_until(lambda: not any(_running(pid) for pid in again), timeout=30), "kill() ends every client's"
