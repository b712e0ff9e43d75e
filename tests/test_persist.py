"""Meshes that outlive the kernel (`--persist`): real kernels are SIGKILLed, restarted and replaced, and
the ranks, their variables, actors, process groups and a background cell's output come back on attach."""

import contextlib
import glob
import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
from conftest import pids_alive, wait_until
from kernel_driver import KernelDriver

pytestmark = pytest.mark.slow

MESH_PIDS = ("from monarch_kernel.magics import current_registry\n"
             "_m = current_registry().get({name!r})\n"
             "print('PIDS', json.dumps([s.pid for s in _m.status()] + [l.host.pid for l in _m._runtime.links]))")


@pytest.fixture
def state_home(tmp_path, monkeypatch):
    """A private XDG_STATE_HOME for the records; every mesh left in it is stopped at the end, however the test ended."""
    home = tmp_path / "state"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    yield str(home)
    for record in glob.glob(str(home / "monarch_kernel" / "meshes" / "*.json")):
        name = os.path.basename(record)[:-5]
        cli(str(home), "stop", name)
        try:
            with open(record) as f:
                pid = json.load(f)["agent_pid"]
            os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def cli(home, *args):
    """`python -m monarch_kernel meshes ...` from a terminal."""
    env = dict(os.environ, XDG_STATE_HOME=home)
    return subprocess.run([sys.executable, "-m", "monarch_kernel", "meshes", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def kernel(home):
    return KernelDriver(extra_env={"XDG_STATE_HOME": home})


def pids_of(k, name):
    run = k.execute("import json\n" + MESH_PIDS.format(name=name), 30)
    return json.loads(next(line for line in run.text().splitlines() if line.startswith("PIDS"))[5:])


def mesh_folders(name):
    return glob.glob(f"/tmp/monarch-{name}-*") + glob.glob(f"/dev/shm/monarch-{name}-*")


def test_a_persistent_mesh_outlives_a_killed_kernel_and_is_attached_refused_taken_over_and_stopped(state_home, tmp_path):
    marker = tmp_path / "finished"
    first = kernel(state_home)
    try:
        up = first.execute("%load_ext monarch_kernel\n%mesh up local --gpus 2 --name keep --persist 5m", 120)
        assert up.status == "ok", up.text()
        made = first.execute(
            "from monarch_kernel import Actor, endpoint\n"
            "from monarch_kernel.magics import current_registry\n"
            "class Counter(Actor):\n    def __init__(self):\n        self.n = 0\n"
            "    @endpoint\n    def bump(self):\n        self.n += 1\n        return self.n\n"
            "mesh = current_registry().get('keep')\n"
            "mesh.run('import torch, torch.distributed as dist\\nw = 10 + dist.get_rank()')\n"
            "print('bumped', list(mesh.spawn('counter', Counter).bump.call().get().values()))", 60)
        assert "bumped [1, 1]" in made.text(), made.text()
        pids = pids_of(first, "keep")
        background = first.submit(
            "%%mesh --bg\nimport time\nfor i in range(8):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.4)\n"
            f"open({str(marker)!r} + str(dist.get_rank()), 'w').close()\n'finished'")
        first.collect(background, 30, until=lambda run: "tick 0" in run.text())
        assert wait_until(lambda: "running In[" in cli(state_home).stdout, 10), cli(state_home).stdout  # (what runs)
        first.kill()
        # the ranks run the cell to its end with no kernel, and stay
        assert wait_until(lambda: all(os.path.exists(f"{marker}{r}") for r in range(2)), 30)
        assert pids_alive(pids) == pids
    finally:
        first.shutdown()

    second = kernel(state_home)
    try:
        attached = second.execute("%load_ext monarch_kernel\n%mesh attach keep", 60)
        text = attached.text()
        assert attached.status == "ok", text
        assert "attached to mesh 'keep'" in text and "tick 7" in text and "'finished'" in text, text
        assert pids_of(second, "keep") == pids  # the same processes
        kept = second.execute("%%mesh\nprint('w is', w)", 30).text()
        assert "w is 10" in kept and "w is 11" in kept, kept
        actor = second.execute("print('bumped', list(current_registry().get('keep').actor_mesh('counter').bump.call().get()"
                               ".values()))", 30).text()
        assert "bumped [2, 2]" in actor, actor  # the actor kept its state
        reduced = second.execute("%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())", 30).text()
        assert "sum 2.0" in reduced, reduced  # the process group made before the kill
        logs = second.execute("%mesh logs --rank 1", 30).text()
        assert "tick 7" in logs, logs

        third = kernel(state_home)
        try:
            refused = third.execute("import monarch_kernel as mk\nmk.attach('keep')", 30)
            assert refused.status == "error"
            assert f"held by another kernel (pid {second.pid}" in refused.text(), refused.text()
            listed = cli(state_home)
            assert f"held by pid {second.pid}" in listed.stdout, listed.stdout
            taken = third.execute("m = mk.attach('keep', take=True)\nprint(sorted(m.run('w').values()))", 30)
            assert "[10, 11]" in taken.text(), taken.text()
            lost = second.execute("%%mesh\nprint(w)", 30)
            assert lost.status == "error" and f"taken over by pid {third.pid}" in lost.text(), lost.text()
            third.km.shutdown_kernel(now=False)  # a kernel that ends well leaves the mesh too
        finally:
            third.shutdown()
    finally:
        second.shutdown()

    assert pids_alive(pids) == pids
    listed = cli(state_home)
    assert "keep: local {hosts: 1, gpus: 2}" in listed.stdout and "no kernel for" in listed.stdout, listed.stdout
    stopped = cli(state_home, "stop", "keep")
    assert "stopped" in stopped.stdout, (stopped.stdout, stopped.stderr)
    assert wait_until(lambda: not pids_alive(pids) and not mesh_folders("keep"), 15), (pids_alive(pids), mesh_folders("keep"))
    assert "no persistent meshes" in cli(state_home).stdout


def test_a_persistent_mesh_without_a_kernel_for_its_duration_leaves_nothing(state_home):
    k = kernel(state_home)
    try:
        k.execute("%load_ext monarch_kernel\n%mesh up local --gpus 1 --dist none --name brief --persist 3s", 60)
        pids = pids_of(k, "brief")
        record = os.path.join(state_home, "monarch_kernel", "meshes", "brief.json")
        assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(record)).st_mode) == 0o700
        k.kill()
        assert pids_alive(pids) == pids  # still there right after the kernel
    finally:
        k.shutdown()
    assert wait_until(lambda: not pids_alive(pids), 30), pids_alive(pids)
    assert not os.path.exists(record) and not mesh_folders("brief")


@pytest.mark.skipif(os.getuid() != 0, reason="another uid is needed: run as root")
def test_another_user_cannot_attach_or_make_the_agent_run_anything(state_home, tmp_path):
    from monarch_kernel import local_mesh
    from monarch_kernel.core.mesh_records import read_record

    mesh = local_mesh(1, dist="none", name="mine", persist="60s")
    try:
        record = read_record("mine")
        # even with the secret handed over and the folder opened up, the agent checks who connects
        os.chmod(record.run_dir, 0o755)
        os.chmod(record.socket, 0o666)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            outcome = "connected"
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(10)
                sock.connect(record.socket)
                outcome = "closed" if sock.recv(64) == b"" else "offered a handshake"
            except OSError as exc:
                outcome = f"refused: {exc}"
            os.write(write, outcome.encode())
            os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        with os.fdopen(read) as f:
            outcome = f.read()
        assert outcome == "closed", outcome
        assert "refused 1 connection(s)" in mesh.agent_log(0) and "another user" in mesh.agent_log(0), mesh.agent_log(0)
        assert list(mesh.run("1").values()) == [1]  # and the mesh is fine
    finally:
        mesh.shutdown()
    assert wait_until(lambda: not mesh_folders("mine"), 10)


def test_stale_forged_and_unsafe_records_are_refused_with_what_to_do(state_home):
    import dataclasses

    from monarch_kernel import MeshUsageError, attach, local_mesh
    from monarch_kernel.core.mesh_records import read_record, record_path, write_record

    def copy(record, name, secret=None, **agent):  # the record of "real" under another name, changed
        agents = [dict(record.agents[0], **agent)]
        return dataclasses.replace(record, name=name, secret=secret or record.secret, agents=agents,
                                   agent_pid=agents[0]["pid"], socket=agents[0]["socket"])

    mesh = local_mesh(1, dist="none", name="real", persist="60s")
    try:
        real = read_record("real")
        write_record(copy(real, "forged", secret="00" * 32))
        with pytest.raises(MeshUsageError, match="did not accept this record's secret.*stale or forged"):
            attach("forged")
        write_record(copy(real, "elsewhere", pid=os.getpid()))
        with pytest.raises(MeshUsageError, match=f"served by pid {real.agent_pid}.*stale or forged"):
            attach("elsewhere")
        write_record(copy(real, "gone", socket=real.socket + ".old"))
        with pytest.raises(MeshUsageError, match="is not running.*meshes stop gone"):
            attach("gone")
        os.chmod(record_path("gone"), 0o644)
        with pytest.raises(MeshUsageError, match="not a private file of yours"):
            attach("gone")
        with pytest.raises(MeshUsageError, match="no persistent mesh named 'nothing'"):
            attach("nothing")
        assert list(mesh.run("1").values()) == [1]  # none of it disturbed the real one
    finally:
        mesh.shutdown()
    assert not os.path.exists(record_path("real"))


def pids_printed_by(first: subprocess.Popen) -> list:
    """The pids a first kernel's program prints as "PIDS [...]" on stderr (its run's own lines come first)."""
    line = ""
    while not line.startswith("PIDS"):
        line = first.stderr.readline()
        assert line, "the first kernel ended early"
    return json.loads(line[5:])


STARTER = """
import json, sys
import monarch_kernel as mk
mesh = mk.local_mesh(2, dist="none", name="busy", persist="60s")
mesh.run_async("import os, time\\nprint('before', flush=True)\\n"
               f"while not os.path.exists({sys.argv[1]!r}):\\n    time.sleep(0.02)\\n"
               "print('after', flush=True)\\n__import__('os').getpid()", name="waiter", background=True)
print("PIDS", json.dumps([s.pid for s in mesh.status()]), file=sys.stderr, flush=True)
import time
time.sleep(600)
"""


def test_a_cell_still_running_at_attach_is_followed_to_its_end_by_the_new_kernel(state_home, tmp_path, capsys):
    from monarch_kernel import attach

    go = str(tmp_path / "go")
    first = subprocess.Popen([sys.executable, "-c", STARTER, go], stderr=subprocess.PIPE, text=True)
    mesh = None
    try:
        pids = pids_printed_by(first)
        first.kill()
        first.wait(10)
        mesh = attach("busy")
        [waiter] = mesh.detached_results
        assert waiter.label == "waiter" and waiter.running == (0, 1), waiter
        open(go, "w").close()
        assert sorted(waiter.future.get(timeout=30).values()) == sorted(pids)  # each rank's value, in this kernel
        assert list(mesh.run("1").values()) == [1, 1]  # and the ranks serve the new kernel after it
    finally:
        if first.poll() is None:
            first.kill()
        if mesh is not None:
            mesh.shutdown()
    assert "after" in capsys.readouterr().out


HOLDER = """
import json, sys
import monarch_kernel as mk
mesh = mk.local_mesh(2, dist="none", name="holder", persist="60s")
mesh.run_async("import ctypes, os, time\\nhold, go = " + repr((sys.argv[1], sys.argv[2])) + "\\n"
               "print('before', flush=True)\\n"
               "while not os.path.exists(hold):\\n    time.sleep(0.02)\\n"
               "open(hold + str(os.getpid()), 'w').close()\\n"
               "ctypes.PyDLL(None).usleep(2_500_000)\\n"  # (a C call that keeps the GIL: the heartbeat waits)
               "while not os.path.exists(go):\\n    time.sleep(0.02)\\n"
               "os.getpid()", name="holder", background=True)
print("PIDS", json.dumps([s.pid for s in mesh.status()]), file=sys.stderr, flush=True)
import time
time.sleep(600)
"""


def test_a_running_cell_whose_ranks_answer_the_attach_late_is_still_followed(state_home, tmp_path):
    """A loaded machine (or a C call holding the GIL) delays a rank's heartbeat answer: the agent waited 1 s
    for it at an attach, and took the running cell for one that had ended ("ran to its end ... no values")."""
    from monarch_kernel import attach

    hold, go = str(tmp_path / "hold"), str(tmp_path / "go")
    first = subprocess.Popen([sys.executable, "-c", HOLDER, hold, go], stderr=subprocess.PIPE, text=True)
    mesh = None
    try:
        pids = pids_printed_by(first)
        first.kill()
        first.wait(10)
        open(hold, "w").close()
        assert wait_until(lambda: all(os.path.exists(hold + str(pid)) for pid in pids), 60)  # (both hold the GIL)
        mesh = attach("holder")
        [holder] = mesh.detached_results
        assert holder.label == "holder" and holder.running == (0, 1), holder
        open(go, "w").close()
        assert sorted(holder.future.get(timeout=30).values()) == sorted(pids)
    finally:
        if first.poll() is None:
            first.kill()
        if mesh is not None:
            mesh.shutdown()


LOUD = """
import json, sys
import monarch_kernel as mk
mesh = mk.local_mesh(1, dist="none", name="loud", persist="60s")
mesh.run_async("import os, time\\n"
               f"while os.path.exists({sys.argv[1]!r}):\\n    time.sleep(0.02)\\n"  # (until the kernel is gone)
               "piece = b'#' * 65536\\n"
               "for _ in range(64 * 16):\\n    os.write(1, piece)\\n"  # 64 MiB on fd 1, not one newline
               "print('the end', flush=True)\\n"
               f"open({sys.argv[1]!r} + '.done', 'w').close()\\n'written'", name="loud", background=True)
print("PIDS", json.dumps([s.pid for s in mesh.status()] + [l.host.pid for l in mesh._runtime.links]),
      file=sys.stderr, flush=True)
import time
time.sleep(600)
"""


def _agent_resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_output_held_without_a_kernel_is_bounded_in_bytes_and_a_lost_link_is_a_detach_not_a_kill(state_home, tmp_path):
    """N18 (High): held output was bounded in "lines" only, went in one frame past the frame limit, and the
    attaching kernel took the failed link for a lost host and SIGKILLed the persistent agent and its ranks."""
    from monarch_kernel import attach
    from monarch_kernel.wire.relay_link import RelayRefused

    gate = tmp_path / "kernel-alive"
    gate.write_text("")
    first = subprocess.Popen([sys.executable, "-c", LOUD, str(gate)], stderr=subprocess.PIPE, text=True)
    mesh = None
    try:
        rank_pid, agent_pid = pids_printed_by(first)
        first.kill()
        first.wait(10)
        baseline = _agent_resident_mib(agent_pid)
        gate.unlink()  # the rank writes its 64 MiB now, with no kernel attached
        assert wait_until(lambda: os.path.exists(f"{gate}.done"), 60)
        assert _agent_resident_mib(agent_pid) - baseline < 48, "the agent held what the rank wrote"
        with contextlib.redirect_stdout(io.StringIO()):  # (attach shows the held output: 8 MiB of '#')
            mesh = attach("loud")
        [loud] = mesh.detached_results
        assert loud.values == {0: "written"} and "the end" in loud.output[0]
        assert len(loud.output[0]) < 20 << 20  # bounded, with a note of what was dropped
        # a link to the persistent agent that fails (a refused frame, a stall) is a detach: nothing is killed
        link = mesh._runtime.state.links[0]
        mesh._runtime.controller.run(_close_link(link, RelayRefused("a record failed its authentication tag"))).result(5)
        assert wait_until(lambda: mesh._runtime.state.ranks[0].host_lost or not mesh._runtime.state.ranks[0].alive, 10)
        assert pids_alive([agent_pid, rank_pid]) == [agent_pid, rank_pid]
        failure = mesh._runtime.state.death_failure(mesh._runtime.state.ranks[0], "died")
        assert "--take" in failure.message and "restart would stop" in failure.message, failure.message
        mesh._runtime._let_go("test")
        mesh = attach("loud", take=True)
        assert list(mesh.run("1").values()) == [1]
    finally:
        if first.poll() is None:
            first.kill()
        if mesh is not None:
            mesh.shutdown()


async def _close_link(link, why):
    link.conn.close(why)


DIES_BEFORE_RECORD = """
import json, os, signal, sys
import monarch_kernel.controller.persistence as persistence

def killed_here(record):  # the kernel dies where it would write the record (all agents said PersistReady)
    print("AGENTS", json.dumps([a["pid"] for a in record.agents]), file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

persistence.write_record = killed_here
import monarch_kernel as mk
mk.local_mesh(2, dist="none", name="unrecorded", persist="10m")
"""


def test_a_kernel_killed_before_the_record_leaves_nothing_running(state_home):
    """N20: the agents outlived a kernel that died between `Persist` and the record: invisible for hours."""
    from monarch_kernel.api.persistent import persistent_meshes

    first = subprocess.Popen([sys.executable, "-c", DIES_BEFORE_RECORD], stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("AGENTS"):
            line = first.stderr.readline()
            assert line, "the kernel ended before the record"
        agents = json.loads(line[7:])
        first.wait(10)
        assert wait_until(lambda: pids_alive(agents) == [], 15), "the agents of an unrecorded mesh stayed"
        assert wait_until(lambda: not mesh_folders("unrecorded"), 10), mesh_folders("unrecorded")
        assert [m.name for m in persistent_meshes()] == []
    finally:
        if first.poll() is None:
            first.kill()


RESTARTER = """
import json, sys, time
import monarch_kernel as mk
mesh = mk.local_mesh(1, dist="none", name="again", persist="60s")
print("AGENT", mesh._runtime.links[0].host.pid, file=sys.stderr, flush=True)
sys.stdin.readline()  # (the test killed the agent)
while mesh._runtime.links[0].is_open:
    time.sleep(0.02)
mesh.restart()
mesh.run("kept = 'after the restart'")
print("AGENT", mesh._runtime.links[0].host.pid, json.dumps([s.pid for s in mesh.status()]), file=sys.stderr,
      flush=True)
time.sleep(600)
"""


def test_a_restart_on_new_agents_keeps_the_mesh_persistent_and_its_record_current(state_home):
    """N19: after the agent died and `restart()` made new ones, they were never told to persist and the record
    named the dead agent: the next kernel SIGKILL took the mesh down."""
    from monarch_kernel import attach

    first = subprocess.Popen([sys.executable, "-c", RESTARTER], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mesh = None
    try:
        def said() -> str:
            line = ""
            while not line.startswith("AGENT"):
                line = first.stderr.readline()
                assert line, "the kernel ended early"
            return line

        old_agent = int(said().split()[1])
        os.killpg(old_agent, signal.SIGKILL)
        first.stdin.write("go\n")
        first.stdin.flush()
        _, new_agent, ranks = said().split(maxsplit=2)
        assert int(new_agent) != old_agent
        first.kill()
        first.wait(10)
        assert pids_alive([int(new_agent), *json.loads(ranks)]) == [int(new_agent), *json.loads(ranks)]
        mesh = attach("again")
        assert list(mesh.pull("kept").values()) == ["after the restart"]
    finally:
        if first.poll() is None:
            first.kill()
        if mesh is not None:
            mesh.shutdown()


def test_a_persistent_ssh_mesh_refuses_passwords_it_would_store_in_its_record(state_home):
    """N25: the record keeps the SSH connect options for the next kernel, so a password given there would sit
    in a file for the mesh's life."""
    from monarch_kernel import ssh_mesh
    from monarch_kernel.core.errors import MeshUsageError

    for option in ("password", "passphrase"):
        with pytest.raises(MeshUsageError, match=f"{option} would be stored there"):
            ssh_mesh(["198.18.0.250"], gpus=1, dist="none", persist="1h", connect_options={option: "hunter2"})
