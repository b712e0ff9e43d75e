"""Faults a busy notebook, a busy rank or a hostile input must survive (issue: never lose the mesh).

Each test failed before its fix; the review's finding is named in the docstring.
"""

import math
import os
import re
import signal
import sys
import time

import cloudpickle
import pytest
from conftest import pids_alive, wait_until

from monarch_kernel import Actor, MeshUsageError, endpoint, local_mesh
from monarch_kernel.wire.messages import HealthTimings

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

QUICK = HealthTimings(ping_interval_s=0.1, host_lost_after_s=1.0, heartbeat_interval_s=0.1,
                      unresponsive_after_s=1.0, controller_silence_s=1.0)


class Sink(Actor):
    @endpoint
    def busy(self, seconds):
        time.sleep(seconds)
        return os.getpid()

    @endpoint
    def take(self, blob):
        return len(blob)


def hold_the_gil(seconds_at_least):
    """One C call that never releases the GIL (a catastrophic regex) for at least this long."""
    n, took = 18, 0.0
    while took < 0.2:  # calibrate on short runs: each more character doubles the time
        n += 1
        start = time.monotonic()
        re.match(r"(a+)+$", "a" * n + "b")
        took = time.monotonic() - start
    n += max(0, math.ceil(math.log2(seconds_at_least / took)))
    start = time.monotonic()
    re.match(r"(a+)+$", "a" * n + "b")
    return time.monotonic() - start


def controller_answers(mesh, timeout):
    """Whether the controller's loop thread runs a trivial job within `timeout` seconds."""
    async def nothing():
        return True

    try:
        return mesh._runtime.controller.run(nothing()).result(timeout)
    except TimeoutError:
        return False


@pytest.fixture
def quick_mesh():
    with local_mesh(gpus=2, dist="none", name="faults", health=QUICK) as mesh:
        yield mesh


def test_calls_queued_to_a_busy_rank_never_block_the_controller_loop(quick_mesh):
    """F1: large calls to a rank busy in a sync endpoint filled its lane; the loop thread blocked writing."""
    sinks = quick_mesh.spawn("sinks", Sink)
    rank0 = sinks.slice(gpus=0)
    pids = [s.pid for s in quick_mesh.status()]
    busy = rank0.busy.call_one(3.0)  # its main thread (which reads the lane) sleeps
    assert wait_until(lambda: (quick_mesh.status()[0].busy_with or "").startswith("Sink.busy"), 10)
    queued = [rank0.take.call_one(b"x" * 300_000) for _ in range(8)]  # more than the socket holds
    time.sleep(0.3)  # let the service tick try to write them
    assert controller_answers(quick_mesh, 0.5)  # the loop thread is free
    assert busy.get(timeout=10) == pids[0]
    assert [q.get(timeout=10) for q in queued] == [300_000] * 8  # every byte arrived, in order
    assert [s.pid for s in quick_mesh.status()] == pids


def test_a_kernel_holding_the_gil_longer_than_every_timeout_keeps_its_mesh(quick_mesh):
    """F2: a C call holding the GIL stopped the pings; the mesh was declared lost (or killed by its agent)."""
    quick_mesh.run("x = 41")
    pids = [s.pid for s in quick_mesh.status()]
    held = hold_the_gil(2.5)  # longer than host_lost_after_s and controller_silence_s (1 s)
    assert held > QUICK.host_lost_after_s + QUICK.controller_silence_s
    assert not wait_until(lambda: any(s.state == "dead" for s in quick_mesh.status()), 2.0)
    assert quick_mesh.run("x + 1").by_rank() == {0: 42, 1: 42}  # namespaces kept
    assert [s.pid for s in quick_mesh.status()] == pids


@pytest.mark.parametrize("name", ["evil/m", "../up", "a" * 65, "sp ace", "new\nline"])
def test_mesh_names_that_could_escape_the_private_folder_are_refused(name):
    """F3: a name with a slash put the private folder under a folder another user could own."""
    with pytest.raises(MeshUsageError, match="mesh name"):
        local_mesh(gpus=1, dist="none", name=name)



def test_a_frozen_local_agent_is_lost_and_nothing_of_it_keeps_running(quick_mesh):
    """F15: a SIGSTOPped agent's ranks were called dead but kept running (and holding their GPU)."""
    ranks = [s.pid for s in quick_mesh.status()]
    agent = quick_mesh._runtime.links[0].host.pid
    os.kill(agent, signal.SIGSTOP)
    try:
        assert wait_until(lambda: all(s.state == "dead" for s in quick_mesh.status()), 10)
        assert "was lost" in quick_mesh.status()[0].exit_text
        assert wait_until(lambda: not pids_alive(ranks + [agent]), 5)
    finally:
        try:
            os.kill(agent, signal.SIGCONT)
        except ProcessLookupError:
            pass
