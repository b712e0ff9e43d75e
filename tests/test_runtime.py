"""The controller's runtime against in-memory host agents: no processes, milliseconds per test.

What runs for real: MeshRuntime, its request book and call router, the Mesh API and its
futures, and every message's encoding. The agents are `agentdouble.AgentDouble`s, and the
clock that judges silence is a `FakeClock` the tests move by hand.
"""

import threading
import time

import pytest
from agentdouble import opener
from conftest import RecordingSink, wait_until

from monarch_kernel.actors.base import Actor, endpoint
from monarch_kernel.actors.client import ActorMesh
from monarch_kernel.api.mesh import Mesh
from monarch_kernel.controller.hosts import HostKind, HostSpec
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.controller.state import MeshSpec
from monarch_kernel.core.errors import ActorDiedError, MeshNotRunningError, MeshStartError, RankDiedError
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.status import RankStatus
from monarch_kernel.wire import messages as m

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)

FAST = m.HealthTimings(ping_interval_s=0.005, host_unreachable_after_s=1.0, host_lost_after_s=3.0)


class FakeClock:
    """Monotonic time that moves only when a test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def world():
    agents, clock = {}, FakeClock()
    hosts = [HostSpec(f"node-{i}", HostKind.SSH, target=f"node-{i}") for i in range(2)]
    runtime = MeshRuntime(MeshSpec("unit", tuple(hosts), 2, "gloo", start_timeout_s=10, health=FAST),
                          opener=opener(agents), clock=clock)
    runtime.start(timeout=10)
    yield Mesh(runtime, Shape.grid(hosts=2, gpus=2)), agents, clock
    runtime.shutdown()


def test_start_runs_ranks_on_every_host_with_the_rendezvous_on_host_0(world):
    mesh, agents, _ = world
    starts = {name: [x for x in a.received if isinstance(x, m.StartRanks)][0] for name, a in agents.items()}
    assert [s.ranks[0].rank for s in starts.values()] == [0, 2]
    assert {s.dist.master_addr for s in starts.values()} == {"198.18.0.1"} and starts["node-1"].master_port == 29_500
    assert starts["node-0"].health == FAST  # each mesh's timings reach its agents
    assert [s.state for s in mesh.status()] == [RankStatus.IDLE] * 4


def test_a_cell_gathers_values_and_output_from_every_host(world):
    mesh, agents, _ = world
    sink = RecordingSink()
    values = mesh.run("x", sink=sink)
    assert values.by_rank() == {0: 0, 1: 10, 2: 20, 3: 30}
    assert sink.text() == {r: f"hello from {r}\n" for r in range(4)}
    assert [len([x for x in a.received if isinstance(x, m.ToRanks)]) for a in agents.values()] == [1, 1]  # one per host
    history = mesh.history()
    ranks = list(history["rank"]) if hasattr(history, "columns") else [r["rank"] for r in history]
    assert ranks == [0, 1, 2, 3]


def test_a_rank_that_dies_fails_its_cell_with_its_exit_and_stderr(world):
    mesh, agents, _ = world
    agents["node-1"].hold = {3}
    future = mesh.run_async("x", sink=RecordingSink())
    wait_until(lambda: 3 in mesh._runtime.ranks and mesh._runtime.ranks[3].inflight, 5)
    agents["node-1"].kill(3)
    with pytest.raises(RankDiedError) as caught:
        future.get(timeout=5)
    failure = caught.value.failures[0]
    assert type(caught.value) is RankDiedError and failure.rank == 3 and failure.signal == "SIGKILL"
    assert "killed by SIGKILL" in failure.message and failure.stderr_tail == ("Fatal Python error",)
    assert caught.value.partial.by_rank()[0] == 0  # the others' values are kept
    assert mesh.status()[3].state == RankStatus.DEAD and mesh.status()[3].exit_text == "killed by SIGKILL"


def test_a_silent_host_is_lost_after_host_lost_after_s_of_its_clock(world):
    mesh, agents, clock = world
    agents["node-1"].hold = {2, 3}
    agents["node-0"].hold = {0, 1}
    future = mesh.run_async("x", sink=RecordingSink())
    wait_until(lambda: mesh._runtime.ranks[2].inflight, 5)
    agents["node-1"].silent = True
    clock.advance(2.0)  # not yet: still within host_lost_after_s
    sent = len(agents["node-0"].received)
    wait_until(lambda: len(agents["node-0"].received) > sent + 3, 5)  # a few more pings went by
    assert mesh._runtime.ranks[2].alive
    clock.advance(2.0)
    wait_until(lambda: not mesh._runtime.ranks[2].alive, 5)
    assert mesh.status()[2].exit_text == "its host node-1 was lost"
    # the ranks still running elsewhere would wait in a collective forever: they are interrupted
    with pytest.raises(RankDiedError, match="lost the connection to host node-1") as caught:
        future.get(timeout=5)
    assert any(isinstance(x, m.InterruptRanks) and x.ranks == (0, 1) and x.req_ids == (future._request.req_id,)
               for x in agents["node-0"].received)
    assert {f.rank: f.kind for f in caught.value.failures} == {0: "interrupted", 1: "interrupted", 2: "died", 3: "died"}


def test_a_quiet_host_is_unreachable_first_and_keeps_its_ranks_until_the_long_limit(world, capsys):
    """N5: three seconds of silence (a push the agent was copying, a saturated NIC) was a host's death
    sentence: its ranks' work failed and its link was closed, which stopped them."""
    mesh, agents, clock = world
    runtime = mesh._runtime
    agents["node-1"].silent = True
    clock.advance(2.0)
    link = runtime.links[1]
    assert wait_until(lambda: link.unreachable, 5)
    assert runtime.ranks[2].alive and link.is_open  # kept
    agents["node-1"].silent = False
    assert wait_until(lambda: not link.unreachable, 5)  # heard again
    shown = capsys.readouterr().err
    assert "host node-1 has not answered for" in shown and "unreachable" in shown and "node-1 answers again" in shown
    agents["node-1"].silent = True
    clock.advance(4.0)
    assert wait_until(lambda: not runtime.ranks[2].alive, 5)  # the long limit: given up
    assert mesh.status()[2].exit_text == "its host node-1 was lost"


def test_an_unresponsive_rank_is_noticed_in_the_running_cell(world):
    mesh, agents, _ = world
    agents["node-0"].hold = {1}
    sink = RecordingSink()
    future = mesh.run_async("x", sink=sink)
    wait_until(lambda: mesh._runtime.ranks[1].inflight, 5)
    agents["node-0"].unresponsive(1)
    wait_until(lambda: mesh.status()[1].state == RankStatus.UNRESPONSIVE, 5)
    future._wait(0.05)  # the waiting thread pumps what came in
    assert any(e[0] == "notice" and e[1] == 1 and "not answering heartbeats" in e[2] for e in sink.events)
    future._cancel()


class Echo(Actor):
    @endpoint
    def hello(self):
        return "hi"


def test_actor_calls_to_remote_hosts_go_through_their_agents(world):
    mesh, agents, _ = world
    echo = ActorMesh(mesh.name, "echo", "Echo", Echo._endpoints, mesh.shape, key="echo#1")
    assert echo.hello.call().get(timeout=5).by_rank() == {r: f"hello on {r}" for r in range(4)}
    calls = [x for a in agents.values() for x in a.received if isinstance(x, m.ActorCall)]
    assert sorted(c.ranks for c in calls) == [(0, 1), (2, 3)]  # one message per host


def test_a_rank_death_fails_the_calls_it_owed(world):
    mesh, agents, _ = world
    agents["node-0"].silent = True  # its ranks never answer
    echo = ActorMesh(mesh.name, "echo", "Echo", Echo._endpoints, mesh.shape.slice(hosts=0), key="echo#1")
    future = echo.hello.call()
    agents["node-0"].silent = False
    agents["node-0"].kill(0)
    agents["node-0"].kill(1)
    with pytest.raises(ActorDiedError) as caught:
        future.get(timeout=5)
    assert sorted(f.rank for f in caught.value.failures) == [0, 1]


def test_a_shut_down_mesh_says_so(world):
    mesh, agents, _ = world
    mesh.shutdown()
    assert all(a.closed.is_set() for a in agents.values())
    with pytest.raises(MeshNotRunningError, match="shut down"):
        mesh.run("x")


def test_a_stall_of_the_controller_loop_itself_does_not_lose_hosts(world):
    """While the kernel holds the GIL no agent's answer is read: after it, silence says nothing yet."""
    mesh, agents, clock = world
    stalled = threading.Event()

    def stall():  # on the loop thread: time passes (5 s on the clock that judges hosts) while it is blocked
        clock.advance(5.0)
        time.sleep(0.8)
        stalled.set()

    mesh._runtime.controller.call(stall)
    assert stalled.wait(5)
    assert not wait_until(lambda: any(s.state == RankStatus.DEAD for s in mesh.status()), 0.5)
    agents["node-1"].silent = True  # a host that really went away is still found
    clock.advance(5.0)
    assert wait_until(lambda: mesh.status()[2].state == RankStatus.DEAD, 5)


@pytest.mark.parametrize("greeting, says", [
    (("monarch_kernel hello", "0.0.9", "0123456789abcdef"), "runs monarch_kernel 0.0.9"),
    (m.Pong(0), "runs an older monarch_kernel"),
])
def test_an_agent_of_another_version_is_named_at_start(greeting, says):
    agents = {}
    runtime = MeshRuntime(MeshSpec("skew", (HostSpec("node-0", HostKind.SSH, target="node-0"),), 1, "none",
                                   start_timeout_s=10), opener=opener(agents, greeting))
    try:
        with pytest.raises(MeshStartError, match=says) as caught:
            runtime.start(timeout=10)
        assert "node-0" in str(caught.value) and "ship_package=True" in str(caught.value)
    finally:
        runtime.shutdown()


def test_a_remote_host_that_names_a_shared_memory_file_here_is_cut_off(world, tmp_path):
    """F9: a ShmRef from a remote host made the notebook map (and remove) a file of this machine."""
    from monarch_kernel.wire.serialization import Sealed, ShmRef, seal

    mesh, agents, _ = world
    victim = tmp_path / "buf-0123456789abcdef"
    victim.write_bytes(b"x" * 64)
    agents["node-1"].hold = {3}
    future = mesh.run_async("x", sink=RecordingSink())
    assert wait_until(lambda: agents["node-1"].held.get(3) is not None, 5)
    forged = Sealed(seal(b"").data, [ShmRef(str(victim), 64, unlink_on_open=True)])
    agents["node-1"].say(m.Gathered(agents["node-1"].held[3], (m.Result(agents["node-1"].held[3], 3, forged, None,
                                                                          1.0, 1.5),)))
    with pytest.raises(RankDiedError, match="shared-memory file") as caught:
        future.get(timeout=5)
    assert {f.rank for f in caught.value.failures} == {3}  # rank 2 had answered already
    assert [s.state for s in mesh.status()] == [RankStatus.IDLE] * 2 + [RankStatus.DEAD] * 2  # node-1 is cut off
    assert victim.exists()
