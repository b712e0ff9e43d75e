"""Nastier Slurm faults on a real test cluster: a node that dies, a link that is cut, a job preempted.

Each test breaks its cluster, so each gets a fresh one (about 3 s to build and tear down).
"""

import os
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import RecordingSink, wait_until
from slurmlab import SlurmTestCluster, unavailable_reason

from monarch_kernel import HealthTimings, slurm_mesh

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


@pytest.fixture
def cluster():
    lab = SlurmTestCluster(2, tempfile.mkdtemp(prefix="slurmlab-"))
    saved = dict(os.environ)
    try:
        lab.start()
        os.environ.update(lab.env)
        yield lab
    finally:
        os.environ.clear()
        os.environ.update(saved)
        lab.stop()


# a node whose network is cut is silent, like one behind a stalled link: it is unreachable after
# 1 s, and given up after 3 s here (15 s by default, so that a stall does not cost the mesh)
PROMPT = HealthTimings(host_unreachable_after_s=1.0, host_lost_after_s=3.0)


def busy_mesh(name: str):
    """A 2-node mesh (ranks 0 and 1) whose ranks are all inside a long cell."""
    mesh = slurm_mesh(nodes=2, gpus=1, dist="none", request_gpus=False, name=name, health=PROMPT)
    job = mesh.run("import os\nos.environ['SLURM_JOB_ID']", sink=RecordingSink()).item(hosts=0, gpus=0)
    future = mesh.run_async("import time\ntime.sleep(120)", sink=RecordingSink())
    assert wait_until(lambda: all(s.state == "busy" for s in mesh.status()), 15)
    return mesh, job, future


@pytest.mark.parametrize("fault", ["fail_node", "cut_link"])
def test_a_node_that_fails_or_drops_off_ends_the_cell_within_5s_naming_job_and_node(cluster, fault):
    mesh, job, future = busy_mesh(fault.replace("_", "-"))
    try:
        broke = time.monotonic()
        getattr(cluster, fault)(1)
        with pytest.raises(Exception, match=rf"(?s)node1.*Slurm job {job} is RUNNING.*node node1 is") as info:
            future.get(timeout=30)
        assert time.monotonic() - broke < 5, time.monotonic() - broke
        assert 1 in [f.rank for f in info.value.failures]  # (rank 0 is interrupted: the cell cannot finish)
        assert "out of reach" in str(info.value)
        statuses = {s.rank: s.state for s in mesh.status()}
        assert statuses[0] != "lost" and statuses[1] in ("lost", "dead"), statuses
    finally:
        started = time.monotonic()
        mesh.shutdown()
        assert time.monotonic() - started < 20  # down does not hang on the node that is gone


def test_a_preempted_job_ends_the_cell_with_slurms_word_and_restart_gets_a_new_allocation(cluster):
    mesh, job, future = busy_mesh("preempted")
    env = {**os.environ, **cluster.env}
    urgent = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-p", "urgent", "-N2", "--exclusive",
                             "--wrap", "sleep 300"],
                            capture_output=True, text=True, env=env, check=True).stdout.strip()
    try:
        submitted = time.monotonic()
        with pytest.raises(Exception, match=rf"Slurm (job {job} is (PREEMPTED|COMPLETING)|no longer knows job {job})"):
            future.get(timeout=30)
        assert time.monotonic() - submitted < 5
        subprocess.run(["scancel", urgent], env=env, check=True)
        mesh.restart()  # the preempted job is over: the same shape is asked for again
        again = mesh.run("import os, socket\n(os.environ['SLURM_JOB_ID'], socket.gethostname())", sink=RecordingSink())
        assert {v[0] for v in again.values()} != {job} and sorted(v[1] for v in again.values()) == ["node0", "node1"]
    finally:
        subprocess.run(["scancel", urgent], env=env)
        mesh.shutdown()
    assert wait_until(lambda: cluster.squeue().strip() == "", 30), cluster.squeue()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
