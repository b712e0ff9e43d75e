"""Multi-host meshes over real SSH: network namespaces, each with its own OpenSSH sshd."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until
from sshhosts import SSHTestHosts, unavailable_reason
from test_dist import DDP_CELL

from monarch_kernel import HealthTimings, MeshStartError, MeshTimeoutError, MeshUsageError, RemoteError, ssh_mesh

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with SSHTestHosts(2, str(tmp_path_factory.mktemp("ssh"))) as test_hosts:
        yield test_hosts


def processes(test_hosts):
    """The processes now running in each test host."""
    return {h.alias: set(test_hosts.pids(h)) for h in test_hosts.hosts}


def back_to(test_hosts, baseline):
    """A check that nothing beyond `baseline` runs in any test host."""
    return lambda: all(now <= baseline[alias] for alias, now in processes(test_hosts).items())


@pytest.fixture(scope="module")
def mesh(hosts):
    m = ssh_mesh([h.alias for h in hosts.hosts], gpus=2, dist="gloo", python=sys.executable,
                 connect_options=hosts.connect_options(), name="ssh-test")
    yield m
    m.shutdown()


def test_two_hosts_two_ranks_run_cells_with_deduped_output(mesh, sink):
    assert mesh.shape.sizes == {"hosts": 2, "gpus": 2}
    vm = mesh.run("import os, socket, torch, torch.distributed as dist\nt = torch.ones(1) * dist.get_rank()\n"
                  "dist.all_reduce(t)\nprint('sum', t.item())\n(os.environ['MASTER_ADDR'], dist.get_rank())", sink=sink)
    assert sink.text() == {r: "sum 6.0\n" for r in range(4)}
    assert [v for v in vm.values()] == [("198.18.0.10", r) for r in range(4)]
    assert {s.host for s in mesh.status()} == {"host-0", "host-1"}


def test_actors_across_hosts(mesh):
    from monarch_kernel import Actor, ActorError, current_rank, endpoint

    class Counter(Actor):
        def __init__(self):
            self.value = 0

        @endpoint
        def add(self, by):
            self.value += by
            return (current_rank().rank, self.value)

        @endpoint
        def fail(self):
            raise KeyError("missing on purpose")

    class Relay(Actor):
        def __init__(self, counters):
            self.counters = counters

        @endpoint
        def ask(self):
            far = self.counters.slice(hosts=1).add.call(10).get()  # via the controller
            near = self.counters.slice(hosts=0, gpus=1).add.call_one(100).get()  # via host 0's agent
            return sorted(far.values()), near

    counters = mesh.spawn("ssh-counters", Counter)
    assert sorted(counters.add.call(1).get().values()) == [(r, 1) for r in range(4)]
    assert counters.slice(hosts=1, gpus=1).add.call_one(1).get() == (0, 2)  # (rank 0 of the slice, as Monarch)
    with pytest.raises(ActorError, match="KeyError") as info:
        counters.slice(hosts=1).fail.call().get()
    assert info.value.ranks == [2, 3] and 'raise KeyError("missing on purpose")' in str(info.value)
    relay = mesh.slice(hosts=0, gpus=0).spawn("ssh-relay", Relay, counters)
    assert relay.ask.call_one().get() == ([(0, 11), (1, 12)], (0, 101))


def test_monarch_host_mesh_of_an_ssh_mesh_spawns_procs_on_its_hosts(mesh, hosts):
    from monarch_kernel.monarch.actor import Actor, Channel, current_rank, endpoint

    class Where(Actor):
        @endpoint
        def where(self, port):
            port.send((dict(current_rank()), os.getpid()))
            return os.getpid()

    host_mesh = mesh.host_mesh()
    assert host_mesh.extent == {"hosts": 2}
    baseline = processes(hosts)
    procs = host_mesh.spawn_procs(per_host={"gpus": 3}, name="ssh-monarch", dist="none")
    try:
        assert procs.extent == {"hosts": 2, "gpus": 3}
        where = procs.spawn("where", Where)
        port, receiver = Channel.open()  # answers from the remote hosts come back through the controller
        pids = where.where.call(port).get()
        seen = sorted((receiver.recv().get(timeout=30) for _ in range(6)), key=lambda s: tuple(s[0].values()))
        assert [coords for coords, _ in seen] == [{"hosts": h, "gpus": g} for h in range(2) for g in range(3)]
        running = processes(hosts)  # each host runs the 3 processes of its row
        for h, host in enumerate(hosts.hosts):
            assert {pid for coords, pid in seen if coords["hosts"] == h} <= running[host.alias] - baseline[host.alias]
        assert sorted(pids.values()) == sorted(pid for _, pid in seen)
        assert mesh.run("1").item(hosts=1, gpus=1) == 1  # the first mesh is untouched
    finally:
        procs.stop()
    assert wait_until(back_to(hosts, baseline), 20)  # its processes are gone from both hosts


def test_actors_of_proc_meshes_on_two_hosts_call_each_other_and_start_processes_there(mesh, hosts):
    """Monarch's ping-pong with each proc mesh on its own SSH host: the calls go through the notebook's
    controller; an actor there starts processes of its own, which the notebook starts on that host."""
    from monarch_kernel.monarch.actor import Actor, current_rank, endpoint, this_host

    class Pong(Actor):
        @endpoint
        async def hit(self, n: int) -> tuple:
            return n + 1, os.getpid()

    class Ping(Actor):
        def __init__(self, pong):
            self.pong = pong.slice(gpus=0)

        @endpoint
        async def rally(self, count: int) -> list:
            return [await self.pong.hit.call_one(i) for i in range(count)]

        @endpoint
        async def helpers(self) -> tuple:
            extra = this_host().spawn_procs(per_host={"gpus": 1})
            try:
                return await extra.spawn("helper", Pong).hit.call_one(41), dict(current_rank())
            finally:
                extra.stop()

    host_mesh = mesh.host_mesh()
    baseline = processes(hosts)
    procs_0 = host_mesh.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, name="ssh-ping", dist="none")
    procs_1 = host_mesh.slice(hosts=1).spawn_procs(per_host={"gpus": 1}, name="ssh-pong", dist="none")
    try:
        pong = procs_1.spawn("pong", Pong)
        ping = procs_0.spawn("ping", Ping, pong)
        rally = ping.slice(gpus=0).rally.call_one(5).get(timeout=60)
        assert [n for n, _ in rally] == [1, 2, 3, 4, 5]
        pong_pids = {pid for _, pid in rally}
        assert pong_pids <= processes(hosts)["host-1"] - baseline["host-1"]  # pong runs on host-1
        (answer, pid), where = ping.slice(gpus=0).helpers.call_one().get(timeout=120)
        assert answer == 42 and where == {}
        assert pid not in pong_pids
    finally:
        procs_0.stop()
        procs_1.stop()
    assert wait_until(back_to(hosts, baseline), 20)


def test_input_on_remote_ranks_is_answered_from_the_notebook(mesh, sink, monkeypatch):
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "typed")
    values = mesh.run("input('go? ') + '!'", sink=sink)
    assert list(values.values()) == ["typed!"] * 4 and asked == ["[ranks 0-3] go? "]


def test_push_and_pull_to_remote_hosts_carry_the_bytes(mesh):
    import torch

    # remote ranks cannot map the controller's shared memory: the bytes travel over SSH
    assert mesh._runtime.state.shm_dir_for(mesh.ranks) is None
    x = torch.randn(1 << 19)
    mesh.push(x=x)
    assert all(torch.equal(v, x * 2) for v in mesh.pull("x * 2").values())


def test_a_push_or_pull_longer_than_the_silence_limit_does_not_lose_the_host(hosts, sink):
    """A 1 GiB push over SSH took 7 s: the agent's pong waited behind it, and after 3 s the
    healthy host was declared lost with its ranks. Bytes arriving, and pongs the agent sends
    unasked, now count as signs of life."""
    import numpy as np

    # (a limit of 0.8 s lost the host now and then on this 2-core machine when another process held a core
    # for that long; the transfer still takes several times the limit, so the test still means something)
    quick = HealthTimings(ping_interval_s=0.3, host_lost_after_s=1.2)
    with ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", preload=[], python=sys.executable,
                  connect_options=hosts.connect_options(), name="slow-bytes", health=quick) as mesh:
        big = np.ones(320 << 20, dtype=np.uint8)  # several times longer to move than the limit
        started = time.monotonic()
        mesh.push(big=big)
        (back,) = mesh.pull("big").values()
        assert time.monotonic() - started > 2 * quick.host_lost_after_s  # the test means something here
        assert back.nbytes == big.nbytes and int(back[-1]) == 1
        assert [str(s.state) for s in mesh.status()] == ["idle"]


def test_a_push_to_several_ranks_of_a_remote_host_is_written_once_there_and_mapped_by_each(hosts, sink):
    """A remote host's agent copied a push to each of its ranks through their sockets; now it
    writes the value once to the host's shared memory and each rank maps it (copy-on-write)."""
    import numpy as np

    with ssh_mesh([hosts.hosts[0].alias], gpus=3, dist="none", preload=[], python=sys.executable,
                  connect_options=hosts.connect_options(), name="shared-push") as mesh:
        big = np.arange(6 << 20, dtype=np.uint8)
        mesh.push(big=big)
        mapped = mesh.run("import numpy as np\nbig[:4] = 7  # each rank's own copy of what it writes\n"
                          "[line.split()[-1] for line in open('/proc/self/maps') if 'monarch-agent-' in line]",
                          sink=sink)
        files = {tuple(paths) for paths in mapped.values()}
        assert len(files) == 1 and len(next(iter(files))) == 1  # one file, the same on every rank
        folder = os.path.dirname(next(iter(files))[0])  # (the test hosts share this machine's /dev/shm)
        assert list(mesh.run("int(big[:4].sum()), int(big[4:].sum() % 251)", sink=sink).values()) == \
            [(28, int(big[4:].astype(np.int64).sum() % 251))] * 3
        mesh.run("del big\nimport gc\ngc.collect()", sink=sink)
        assert wait_until(lambda: not any(n.startswith(("buf-", "hold-")) for n in os.listdir(folder)), 10), \
            os.listdir(folder)  # every rank let go
        assert any(n.startswith("free-") for n in os.listdir(folder))  # kept for the next push
    assert not os.path.exists(folder)  # the agent's folder goes with it


def test_an_actor_call_to_several_ranks_of_a_remote_host_writes_its_arguments_once_there(hosts, sink):
    """As for pushes: the agent writes a call's large arguments once to the host's shared memory and each
    of its ranks maps them; the file is released when every rank answered."""
    import numpy as np

    from monarch_kernel import Actor, endpoint

    class Mapper(Actor):
        @endpoint
        def look(self, big):
            big[:4] = 9  # a rank's writes are its own
            return int(big[4:].sum() % 251), [line.split()[-1] for line in open("/proc/self/maps")
                                               if "monarch-agent-" in line]

    with ssh_mesh([hosts.hosts[0].alias], gpus=3, dist="none", preload=[], python=sys.executable,
                  connect_options=hosts.connect_options(), name="shared-call") as mesh:
        mappers = mesh.spawn("mappers", Mapper)
        big = np.arange(6 << 20, dtype=np.uint8)
        answers = list(mappers.look.call(big).get(timeout=60).values())
        assert {total for total, _ in answers} == {int(big[4:].astype(np.int64).sum() % 251)}
        files = {tuple(paths) for _, paths in answers}
        assert len(files) == 1 and len(next(iter(files))) == 1  # one file, mapped by all three ranks
        folder = os.path.dirname(next(iter(files))[0])
        assert big[:4].tolist() == [0, 1, 2, 3]  # nothing came back into ours
        assert wait_until(lambda: not any(n.startswith(("buf-", "hold-")) for n in os.listdir(folder)), 10), \
            os.listdir(folder)  # released once every rank answered
        assert any(n.startswith("free-") for n in os.listdir(folder))


def test_slices_by_host(mesh, sink):
    assert mesh.slice(hosts=1).pull("dist.get_rank()").by_rank() == {2: 2, 3: 3}
    vm = mesh.slice(hosts=slice(0, 2), gpus=1).run("import os\nos.environ['LOCAL_RANK']", sink=sink)
    assert vm.by_rank() == {1: "1", 3: "1"}


def test_ddp_across_hosts_gives_identical_parameters(mesh, sink):
    running = mesh.run_async(DDP_CELL, sink=sink)
    if not wait_until(running.done, 90):  # (it takes about a second; a hang here has been seen in CI, rarely)
        said = f"{mesh.why()}\n\n{mesh.stacks(all_threads=True)}"  # where each rank is, for CI's log
        with pytest.raises(MeshTimeoutError):
            running.get(timeout=1)  # stopped, so that the module's mesh serves the next tests
        pytest.fail(f"DDP across hosts did not finish in 90 s:\n{said}")
    results = list(running.get(timeout=10).values())
    reference = results[0][2]
    assert all(bool((flat == reference).all()) and last < first for first, last, flat in results)


def test_rank_killed_on_host_1_names_the_host(hosts, sink):
    baseline = processes(hosts)
    with ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                  connect_options=hosts.connect_options(), name="ssh-kill") as m:
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            m.run("import os, time\nif os.environ['RANK'] == '1':\n    os._exit(9)\ntime.sleep(0.5)", sink=sink)
        assert time.monotonic() - start < 3
        failure = info.value.failures[0]
        assert failure.rank == 1 and failure.host == "host-1" and failure.exit_code == 9
    assert wait_until(back_to(hosts, baseline), 10)


def test_a_lost_host_stops_the_other_hosts_cells_even_those_not_started_there(hosts, sink):
    """A CI fault storm: the other host's ranks had not started the cell when the stop came,
    dropped it (a bare SIGINT outside user code is ignored) and ran the whole cell."""
    with ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                  connect_options=hosts.connect_options(), name="ssh-lost-queued") as m:
        running = m.run_async("import time\ntime.sleep(60)", sink=sink)
        assert wait_until(lambda: all(s.state == "busy" for s in m.status()), 10)
        queued = m.run_async("import time\ntime.sleep(60)\n'ran'", sink=sink)  # behind it on every rank
        with open(f"/proc/{m.status()[1].pid}/stat") as f:
            agent = int(f.read().rsplit(")", 1)[1].split()[1])  # host-1's agent: its rank's parent
        killed = time.monotonic()
        os.kill(agent, signal.SIGKILL)
        for future in (running, queued):
            with pytest.raises(RemoteError) as info:
                future.get(timeout=30)
            assert not isinstance(info.value, MeshTimeoutError)
            assert {f.rank: f.kind for f in info.value.failures} == {0: "interrupted", 1: "died"}
        assert time.monotonic() - killed < 15  # not the queued cell's 60 s on host-0
        assert m.status()[0].state == "idle"


def test_unknown_host_key_is_rejected_with_advice(hosts, tmp_path):
    baseline = processes(hosts)
    options = dict(hosts.connect_options(), known_hosts=str(tmp_path / "empty_known_hosts"))
    (tmp_path / "empty_known_hosts").write_text("")
    with pytest.raises(MeshStartError) as info:
        ssh_mesh(["host-0"], gpus=1, dist="none", python=sys.executable, connect_options=options)
    text = str(info.value)
    assert "host-0" in text and "known_hosts" in text and "never accepts unknown keys" in text
    assert wait_until(back_to(hosts, baseline), 5)


def test_unreachable_host_is_reported_and_nothing_is_left_on_the_others(hosts):
    baseline = processes(hosts)
    start = time.monotonic()
    with pytest.raises(MeshStartError) as info:
        ssh_mesh(["host-0", "root@198.18.0.99"], gpus=1, dist="none", python=sys.executable,
                 connect_options=hosts.connect_options(), connect_timeout=2)
    assert time.monotonic() - start < 15
    text = str(info.value)
    assert "could not start on 1 of 2 hosts" in text and "198.18.0.99" in text
    assert wait_until(back_to(hosts, baseline), 10)


def test_missing_monarch_kernel_names_host_and_interpreter(hosts):
    with pytest.raises(MeshStartError) as info:
        ssh_mesh(["host-0"], gpus=1, dist="none", python="/usr/bin/python3",
                 connect_options=hosts.connect_options(), timeout=30)
    text = str(info.value)
    assert "host-0" in text and "/usr/bin/python3" in text and "ship_package=True" in text


def test_link_cut_mid_cell_is_detected_and_cleaned_up(hosts, sink):
    baseline = processes(hosts)
    # a cut link may never close the SSH session: agents stop their ranks after this much
    # silence (15 minutes by default, so that a busy kernel keeps its mesh; short here)
    # (and the controller gives a silent host up after host_lost_after_s: 15 s by default, 4 here)
    patience = HealthTimings(controller_silence_s=4.0, host_unreachable_after_s=1.5, host_lost_after_s=4.0)
    m = ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                 connect_options=hosts.connect_options(), name="ssh-cut", health=patience)
    try:
        future = m.run_async("import time\ntime.sleep(60)", sink=sink)
        assert wait_until(lambda: all(s.state == "busy" for s in m.status()), 10)
        cut = time.monotonic()
        hosts.cut_link(hosts.hosts[1])
        with pytest.raises(RemoteError) as info:
            future.get(timeout=20)
        assert time.monotonic() - cut < 8
        lost = [f for f in info.value.failures if f.rank == 1][0]
        assert "host-1" in lost.message and "lost" in lost.message
        assert m.status()[1].state == "dead"
        # the agent on the cut-off host notices the silence and takes its rank down
        assert wait_until(lambda: processes(hosts)["host-1"] <= baseline["host-1"], 12)
        hosts.restore_link(hosts.hosts[1])
        m.restart()  # the host is back: a fresh mesh of the same shape
        assert m.pull("int(__import__('os').environ['RANK'])").by_rank() == {0: 0, 1: 1}
    finally:
        hosts.restore_link(hosts.hosts[1])
        m.interrupt()
        m.shutdown()


def test_user_known_hosts_file_none_in_the_default_ssh_config_is_refused(hosts, tmp_path, monkeypatch):
    """The setting in the user's own ~/.ssh/config (read by default, no config= given): refused, nothing starts."""
    baseline = processes(hosts)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    host = hosts.hosts[0]
    (home / ".ssh" / "config").write_text(f"Host lab-unchecked\n  HostName {host.address}\n  User root\n"
                                          f"  IdentityFile {hosts.key}\n  UserKnownHostsFile none\n")
    (home / ".ssh" / "known_hosts").write_text("")  # the host's key is in no known_hosts
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(MeshStartError, match="UserKnownHostsFile none"):
        ssh_mesh(["lab-unchecked"], gpus=1, dist="none", python=sys.executable, timeout=30)
    assert wait_until(back_to(hosts, baseline), 5)


def test_magics_on_ssh_hosts_read_the_users_ssh_config(hosts, tmp_path, monkeypatch):
    from conftest import ipython_shell as get_ipython
    from IPython.utils.capture import capture_output

    monkeypatch.setenv("HOME", hosts.install_home(str(tmp_path)))
    ip = get_ipython()
    ip.run_line_magic("load_ext", "monarch_kernel")
    try:
        with capture_output() as cap:
            ok = ip.run_cell(f"%mesh up ssh host-0 host-1 --gpus 1 --dist gloo --python {sys.executable} --name magic")
        shown = cap.stdout + "".join(o.data.get("text/plain", "") for o in cap.outputs)
        assert ok.success, shown + cap.stderr
        assert "mesh 'magic' {hosts: 2, gpus: 1}" in shown and "host-1" in shown
        with capture_output() as cap:
            result = ip.run_cell("%%mesh\nimport socket, torch.distributed as dist\nprint('world', dist.get_world_size())\n"
                                 "dist.get_rank()")
        assert "[0-1] world 2" in cap.stdout and list(result.result.values()) == [0, 1]
        with capture_output() as cap:
            ip.run_cell("%mesh logs host-1")
        assert "--- agent on host host-1" in cap.stdout
    finally:
        ip.run_line_magic("unload_ext", "monarch_kernel")


def test_kernel_killed_leaves_nothing_on_the_hosts(hosts, tmp_path):
    from kernel_driver import KernelDriver

    baseline = processes(hosts)
    home = hosts.install_home(str(tmp_path))
    k = KernelDriver(extra_env={"HOME": home})
    try:
        run = k.execute(f"import monarch_kernel\nm = monarch_kernel.ssh_mesh(['host-0', 'host-1'], gpus=2, dist='gloo', "
                        f"python={sys.executable!r})\nprint(len(m.status()))", 120)
        assert "4" in run.text(), run.text()
        assert not back_to(hosts, baseline)()  # agents and ranks are running there now
        k.kill()
        assert wait_until(back_to(hosts, baseline), 10)
    finally:
        k.shutdown()


def test_ssh_notebook_runs_end_to_end_on_the_test_hosts(hosts, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "03_ssh_hosts.ipynb")
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, HOME=hosts.install_home(str(tmp_path)), MONARCH_SSH_HOSTS="host-0 host-1",
               MONARCH_SSH_GPUS="2", MONARCH_SSH_DIST="gloo", MONARCH_SSH_PYTHON=sys.executable)
    NotebookClient(nb, timeout=300, kernel_name="python3").execute(env=env)
    texts = ["\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in c.outputs)
             for c in nb.cells if c.cell_type == "code"]
    assert any("[0-3] MASTER_ADDR 198.18.0.10 world 4" in t for t in texts)
    assert any("[0-1] group rank 0" in t and "[2-3] group rank 1" in t for t in texts)
    assert any("all ranks: [6.0, 6.0, 6.0]" in t for t in texts)
    ddp = [t for t in texts if "all ranks:" in t and "all ranks: [6.0" not in t]  # (a cell's timing may read 6.00 s)
    assert ddp, texts  # one identical parameter checksum on all four ranks
    assert "is down" in texts[-1]


def test_ship_package_makes_a_host_with_only_torch_work(hosts, tmp_path, sink):
    import site
    import subprocess

    # an interpreter that has torch (and friends) but not monarch_kernel
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    packages = [p for p in site.getsitepackages() if p.endswith("site-packages")][0]
    lib = next((bare / "lib").iterdir()) / "site-packages"
    (lib / "deps.pth").write_text(packages + "\n")  # a plain path: editable installs stay out
    python = str(bare / "bin" / "python")
    probe = subprocess.run([python, "-c", "import torch, cloudpickle; import monarch_kernel"], capture_output=True,
                           cwd=str(tmp_path))
    assert b"No module named 'monarch_kernel'" in probe.stderr
    with pytest.raises(MeshStartError, match="not importable on host host-1"):
        ssh_mesh(["host-1"], gpus=1, dist="none", python=python, connect_options=hosts.connect_options())
    with ssh_mesh(["host-1"], gpus=1, dist="gloo", python=python, ship_package=True,
                  connect_options=hosts.connect_options()) as m:
        where = m.run("import monarch_kernel, torch.distributed as dist\n(monarch_kernel.__file__, dist.get_world_size())",
                      sink=sink).item(hosts=0, gpus=0)
        assert "/monarch-pkg-" in where[0] and where[1] == 1
        shipped = where[0].split("/monarch_kernel/")[0]
    assert wait_until(lambda: not os.path.exists(shipped), 10)  # the agent removed it on exit


def test_a_host_whose_internal_operations_differ_is_refused_at_connect_naming_both_versions(hosts, tmp_path):
    """A host with an older monarch_kernel (one of its internal operations has other fields) is refused
    when its agent says hello, before anything runs there: not later, inside a misread operation."""
    import shutil
    import site
    import subprocess

    import monarch_kernel
    from monarch_kernel.wire import handshake

    older = tmp_path / "older"
    shutil.copytree(Path(monarch_kernel.__file__).parent, older / "monarch_kernel",
                    ignore=shutil.ignore_patterns("__pycache__", "labextension"))
    ops_file = older / "monarch_kernel" / "wire" / "ops.py"
    ops_file.write_text(ops_file.read_text().replace("    touches: dict[str, int] | None = None\n", ""))
    versions_file = older / "monarch_kernel" / "core" / "versions.py"
    versions_file.write_text(re.sub(r'__version__ = "[^"]+"', '__version__ = "0.11.0"', versions_file.read_text()))
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    packages = [p for p in site.getsitepackages() if p.endswith("site-packages")][0]
    lib = next((bare / "lib").iterdir()) / "site-packages"
    (lib / "deps.pth").write_text(f"{older}\n{packages}\n")  # the older copy first; torch and the rest after
    python = str(bare / "bin" / "python")
    probe = subprocess.run([python, "-c", "import monarch_kernel.wire.handshake as h; print(h.PROTOCOL)"],
                           capture_output=True, text=True, cwd=str(tmp_path))
    assert probe.stdout.strip() not in ("", handshake.PROTOCOL), probe.stderr
    baseline = processes(hosts)
    with pytest.raises(MeshStartError) as info:
        ssh_mesh(["host-1"], gpus=1, dist="none", python=python, connect_options=hosts.connect_options(), timeout=60)
    text = str(info.value)
    assert "host-1" in text and "monarch_kernel 0.11.0" in text and monarch_kernel.__version__ in text
    assert probe.stdout.strip() in text and handshake.PROTOCOL in text
    assert wait_until(back_to(hosts, baseline), 10)  # nothing of it keeps running there


def test_changed_host_key_is_rejected(hosts, tmp_path):
    import subprocess

    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join(open(f"{other}.pub").read().split()[:2])
    (tmp_path / "known_hosts").write_text(f"host-0,198.18.0.10 {wrong}\n")
    options = dict(hosts.connect_options(), known_hosts=str(tmp_path / "known_hosts"))
    with pytest.raises(MeshStartError, match="host-0.*known_hosts.*never accepts unknown keys"):
        ssh_mesh(["host-0"], gpus=1, dist="none", python=sys.executable, connect_options=options)


def behind_a_jump_host(hosts, tmp_path):
    """connect_options where "behind" is host-1 reached through host-0 (ProxyJump in the config)."""
    config = tmp_path / "ssh_config"
    config.write_text(open(hosts.config).read() + f"\nHost behind\n  HostName {hosts.hosts[1].address}\n"
                      f"  User root\n  IdentityFile {hosts.key}\n  ProxyJump host-0\n")
    known = tmp_path / "known_hosts"
    lines = open(hosts.known_hosts).read().splitlines()
    known.write_text("\n".join(lines + [line.replace("host-1,", "behind,", 1) for line in lines
                                        if line.startswith("host-1,")]) + "\n")
    options = {"config": [str(config)], "known_hosts": str(known), "client_keys": [hosts.key]}
    return options


def test_proxyjump_in_the_ssh_config_is_followed(hosts, tmp_path):
    # "behind" is host-1 reached through host-0, as `ssh behind` would with this config
    options = behind_a_jump_host(hosts, tmp_path)
    with ssh_mesh(["behind"], gpus=1, dist="none", python=sys.executable, connect_options=options,
                  name="jumped") as m:
        # the agent's SSH connection came from host-0's address, not from this machine's
        client = m.run("import os\nos.environ['SSH_CONNECTION'].split()[0]").item(hosts=0, gpus=0)
        assert client == hosts.hosts[0].address


def _negotiated_cipher(options: dict) -> str:
    import asyncio

    from monarch_kernel.controller.ssh import SSHTarget, connect

    async def probe() -> str:
        conn = await connect(SSHTarget("host-0"), options=options, timeout=10)
        try:
            return conn.get_extra_info("send_cipher")
        finally:
            conn.close()

    return asyncio.run(probe())


def test_aes_gcm_is_preferred_unless_the_config_chooses_ciphers(hosts, tmp_path):
    assert _negotiated_cipher(hosts.connect_options()) == "aes128-gcm@openssh.com"
    chosen = tmp_path / "ssh_config"
    chosen.write_text("Host host-0\n  Ciphers aes256-ctr\n" + open(hosts.config).read())
    assert _negotiated_cipher({**hosts.connect_options(), "config": [str(chosen)]}) == "aes256-ctr"


def test_an_ssh_agent_that_gives_up_on_a_silent_controller_reports_the_deaths(hosts, sink):
    """F2 (b): the agent's own watchdog stopped the ranks and called it expected: the cell hung."""
    from test_faults import hold_the_gil

    from monarch_kernel.core.errors import RankDiedError
    from monarch_kernel.wire.messages import HealthTimings

    impatient = HealthTimings(host_lost_after_s=30.0, controller_silence_s=1.0)
    m = ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=sys.executable,
                 connect_options=hosts.connect_options(), name="ssh-silent", health=impatient)
    try:
        future = m.run_async("import time\ntime.sleep(60)", sink=sink)
        assert wait_until(lambda: m.status()[0].state == "busy", 10)
        hold_the_gil(2.5)  # the controller says nothing for longer than the agent waits
        with pytest.raises(RankDiedError) as caught:
            future.get(timeout=20)
        assert caught.value.failures[0].rank == 0
    finally:
        m.shutdown()


def test_env_values_never_appear_on_a_command_line_of_the_host(hosts):
    """F6: env= values were part of the remote command, visible in ps to every user of the host."""
    secret = "hf_not_for_your_eyes_42"
    seen, starting = [], threading.Event()

    def watch():  # every process of the host, while the agent starts (setup sleeps a while)
        while not starting.is_set():
            for pid in hosts.pids(hosts.hosts[0]):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if secret.encode() in f.read():
                            seen.append(pid)
                except OSError:
                    pass
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        m = ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=sys.executable, setup="sleep 1 # warm up",
                     env={"HF_TOKEN": secret}, connect_options=hosts.connect_options(), name="ssh-env")
    finally:
        starting.set()
        watcher.join()
    try:
        assert seen == []
        assert list(m.run("import os\nos.environ['HF_TOKEN']").values()) == [secret]  # the ranks have it
    finally:
        m.shutdown()


def test_a_large_environment_and_a_setup_that_reads_stdin_still_start_the_agent(hosts, sink):
    """N12: an env= over 64 KiB could not start a remote agent (one line of at most 64 KiB), and a
    --setup that read stdin swallowed the environment and the secret."""
    big = "x" * 200_000
    m = ssh_mesh(["host-0"], gpus=1, dist="none", python=sys.executable, connect_options=hosts.connect_options(),
                 env={"MK_BIG": big}, setup="read -r swallowed || true", name="ssh-bigenv", timeout=60)
    try:
        assert m.pull("len(__import__('os').environ['MK_BIG'])").by_rank() == {0: len(big)}
    finally:
        m.shutdown()


def test_the_users_ssh_agent_is_not_forwarded_unless_asked(hosts, tmp_path):
    """F7: ForwardAgent yes in the user's config handed their SSH keys to every rank."""
    agent = subprocess.run(["ssh-agent", "-a", str(tmp_path / "agent.sock")], capture_output=True, text=True,
                           check=True).stdout
    agent_pid = int(agent.split("SSH_AGENT_PID=")[1].split(";")[0])
    config = tmp_path / "ssh_config"
    config.write_text(open(hosts.config).read() + "\nHost *\n  ForwardAgent yes\n")
    options = {**hosts.connect_options(), "config": [str(config)], "agent_path": str(tmp_path / "agent.sock")}
    try:
        m = ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=sys.executable,
                     connect_options=options, name="ssh-noforward")
        try:
            assert list(m.run("import os\n'SSH_AUTH_SOCK' in os.environ").values()) == [False]
        finally:
            m.shutdown()
        m = ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=sys.executable,
                     connect_options={**options, "agent_forwarding": True}, name="ssh-forward")
        try:
            assert list(m.run("import os\n'SSH_AUTH_SOCK' in os.environ").values()) == [True]  # asked for: forwarded
        finally:
            m.shutdown()
    finally:
        os.kill(agent_pid, signal.SIGTERM)


def test_turning_host_key_checks_off_must_be_said_twice(hosts):
    """F8: known_hosts=None silently accepted any host key."""
    with pytest.raises(MeshStartError, match="insecure_no_host_key_check"):
        ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=sys.executable,
                 connect_options={**hosts.connect_options(), "known_hosts": None}, name="ssh-nokeys")


def test_request_tty_force_in_the_users_config_does_not_break_the_start(hosts, tmp_path):
    """F19: RequestTTY force put a terminal on the binary channel: the agent exited at once."""
    config = tmp_path / "ssh_config"
    config.write_text(open(hosts.config).read() + "\nHost *\n  RequestTTY force\n")
    m = ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=sys.executable,
                 connect_options={**hosts.connect_options(), "config": [str(config)]}, name="ssh-tty")
    try:
        assert list(m.run("1 + 1").values()) == [2]
    finally:
        m.shutdown()


@pytest.mark.parametrize("env", [{"X$(id>/tmp/owned)": "1"}, {"A B": "1"}, {"9LIVES": "1"}])
def test_env_keys_must_be_variable_names(env):
    """F17: an env key was pasted unquoted into the remote shell command."""
    from monarch_kernel import MeshUsageError

    with pytest.raises(MeshUsageError, match="not variable names"):
        ssh_mesh(["host-0"], gpus=1, env=env)


def test_a_failed_start_with_ship_leaves_no_copy_on_the_host(hosts):
    """F18: --ship with a wrong python left /tmp/monarch-pkg-<hex> on the host at every attempt."""
    import glob

    before = set(glob.glob("/tmp/monarch-pkg-*"))  # the test hosts share this machine's /tmp
    with pytest.raises(MeshStartError, match="not found"):
        ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python="/no/such/python3", ship_package=True,
                 connect_options=hosts.connect_options(), name="ssh-badship")
    assert wait_until(lambda: set(glob.glob("/tmp/monarch-pkg-*")) <= before, 10)


def test_a_gloo_mesh_through_a_jump_host_learns_the_hosts_address(hosts, tmp_path, sink):
    """Through ProxyJump the connection has no peer address: MASTER_ADDR comes from the host (F5)."""
    options = behind_a_jump_host(hosts, tmp_path)
    with ssh_mesh(["behind", "host-0"], gpus=1, dist="gloo", python=sys.executable, connect_options=options,
                  name="jumpgloo", timeout=60) as m:
        vm = m.run("import os, torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                   "(os.environ['MASTER_ADDR'], t.item())", sink=sink, timeout=60)
        assert list(vm.values()) == [(hosts.hosts[1].address, 2.0)] * 2


def test_master_addr_that_names_every_interface_is_refused():
    with pytest.raises(MeshUsageError, match="0.0.0.0"):
        ssh_mesh(["host-0"], gpus=1, dist="gloo", master_addr="0.0.0.0")


def test_a_copy_left_by_a_killed_agent_is_swept_by_the_next_ship(hosts, sink):
    """F18: an agent killed with its kernel (SIGKILL, an SSH drop) left its --ship copy on the host."""
    import tempfile

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    folders = {}
    for label, owner in (("dead", gone.pid), ("alive", os.getpid()), ("unowned", None)):
        folder = tempfile.mkdtemp(prefix="monarch-pkg-", dir="/tmp")
        if owner is not None:
            with open(os.path.join(folder, ".owner"), "w") as f:
                f.write(str(owner))
        folders[label] = folder
    # a live agent holds the lock on its copy's .owner for its life (core/folders.py): so does this one
    holder = subprocess.Popen(["flock", os.path.join(folders["alive"], ".owner"), "sleep", "300"])
    assert wait_until(lambda: subprocess.run(["flock", "-n", os.path.join(folders["alive"], ".owner"), "true"])
                      .returncode != 0, 10)
    try:
        with ssh_mesh(["host-1"], gpus=1, dist="none", python=sys.executable, ship_package=True,
                      connect_options=hosts.connect_options(), name="ship-next") as m:
            assert m.run("1", sink=sink).values() is not None
        assert not os.path.exists(folders["dead"])  # its agent is gone: swept
        assert os.path.exists(folders["alive"]) and os.path.exists(folders["unowned"])  # not ours to judge
    finally:
        import shutil

        holder.kill()
        holder.wait()
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)


def test_the_planner_measures_links_per_host_and_across_and_trains_a_pipeline_over_two_hosts(hosts):
    """(A mesh of its own: the module's mesh has lived through the link-cut test's cut by now. Its SSH
    keepalive allows 15 silent seconds, not 3: the collectives of four ranks on two cores once starved
    a host's answers for longer, and this test is about the planner, not about losing hosts.)"""
    import cloudpickle
    import planner_models as pm

    from monarch_kernel.planner.apply import TrainingSpec, reference_losses
    cloudpickle.register_pickle_by_value(pm)
    cloudpickle.register_pickle_by_value(pm.gpt_model)
    with ssh_mesh([h.alias for h in hosts.hosts], gpus=2, dist="gloo", python=sys.executable,
                  connect_options={**hosts.connect_options(), "keepalive_count_max": 15}, name="ssh-planner") as mesh:
        _plan_and_train_over_two_hosts(mesh, pm, TrainingSpec, reference_losses)


def _plan_and_train_over_two_hosts(mesh, pm, TrainingSpec, reference_losses):
    from monarch_kernel.wire.ops import MeasureRank

    for figures in mesh._ask(MeasureRank(), "measure the ranks", timeout=120).values():
        links = figures.links
        assert set(links["intra"]) == set(links["inter"]) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
        assert all(ranks == 2 for _, _, ranks in links["intra"].values())  # each host's own two ranks
        assert links["inter"]["all_reduce"][2] == 4 and links["inter"]["send_recv"][2] == 2  # the mesh; host pairs
        assert all(latency > 0 and 0 < bandwidth < float("inf") for latency, bandwidth, _ in
                   [*links["intra"].values(), *links["inter"].values()])
    plan = mesh.plan(pm.build, pm.batch, loss=pm.lm_loss, memory="1GiB", strategies=("fsdp", "pp"))
    assert {"fsdp=4", "pp=2,fsdp=2"} <= set(plan.layouts()) and plan.hosts == 2
    plan.apply("pp=2,fsdp=2")  # a stage per host, FSDP inside each: activations cross between the hosts
    mesh.push(_batch=pm.batch)
    losses = mesh.run("[train_step(_batch()) for _ in range(3)]", timeout=120)
    expected = reference_losses(TrainingSpec(pm.build, pm.lm_loss, "adamw", None, 0), [pm.batch()] * 3)
    for got in losses.values():
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, expected)), (got, expected)


FIRST_KERNEL = """
import json, sys
import monarch_kernel as mk
mesh = mk.ssh_mesh(["host-0", "host-1"], gpus=1, dist="gloo", python=sys.executable,
                   connect_options=json.loads(sys.argv[1]), name="sshkeep", persist="5m")
mesh.run("import torch, torch.distributed as dist\\nw = 100 + dist.get_rank()")
mesh.run_async(f"open({sys.argv[2]!r} + 'started' + str(dist.get_rank()), 'w').close()\\n"
               "import time\\nfor i in range(3):\\n    print(f'step {i}', flush=True)\\n    time.sleep(0.3)\\n"
               f"open({sys.argv[2]!r} + str(dist.get_rank()), 'w').close()\\n'trained'", name="fit", background=True)
import os, time
deadline = time.monotonic() + 60  # (until it reached both ranks: a request still in this process dies with it)
while not all(os.path.exists(f"{sys.argv[2]}started{r}") for r in range(2)) and time.monotonic() < deadline:
    time.sleep(0.01)
print("PIDS", json.dumps([s.pid for s in mesh.status()]), file=sys.stderr, flush=True)
time.sleep(600)
"""


TAKER = """
import monarch_kernel as mk
try:
    mk.attach("sshkeep")
except mk.MeshUsageError as exc:
    print(exc)
m = mk.attach("sshkeep", take=True)
print("took it:", sorted(m.pull("w").values()), flush=True)
"""


def test_a_persistent_ssh_mesh_with_no_kernel_for_its_duration_stops_on_its_hosts(hosts, tmp_path, monkeypatch):
    from monarch_kernel import persistent_meshes, stop_persistent

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    mesh = ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                    connect_options=hosts.connect_options(), name="sshbrief", persist="2s")
    pids = [s.pid for s in mesh.status()]
    mesh.leave()  # what a kernel's end does
    assert [m.running for m in persistent_meshes()] == [True]
    try:
        assert wait_until(lambda: not _agents_running("host-0") and not _agents_running("host-1"), 30)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
        assert [m.running for m in persistent_meshes()] == [False]  # the record says it is gone
    finally:
        stop_persistent("sshbrief")
    assert not persistent_meshes()


def _agents_running(name):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "monarch_kernel.agent" in cmd and f"--host {name}" in cmd and "--persist" in cmd:
            found.append(int(pid))
    return found


def _why_not_trained(mesh) -> str:
    """What the ranks of a persistent mesh do and said, when its background cell did not end."""
    return (f"the background cell did not end: {mesh.status()}\n{mesh.stacks(all_threads=True)}\n"
            f"{mesh.detached_results}\n{mesh.agent_log(0)}\n{mesh.agent_log(1)}")


def test_a_persistent_ssh_mesh_outlives_its_kernel_and_a_new_one_attaches_over_ssh(hosts, tmp_path, monkeypatch):
    """The agents stay on the hosts when the kernel that started them is SIGKILLed; a new kernel reaches them over
    new SSH connections (a forwarded Unix socket: no port opened), with the ranks' state and process group."""
    from monarch_kernel import attach, persistent_meshes

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    marker = str(tmp_path / "trained")
    first = subprocess.Popen([sys.executable, "-c", FIRST_KERNEL, json.dumps(hosts.connect_options()), marker],
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    mesh = None
    try:
        line = next((line for line in iter(first.stderr.readline, "") if line.startswith("PIDS")), "")
        assert line, "the first kernel ended early"
        pids = json.loads(line[5:])
        first.kill()
        first.wait(10)
        trained = wait_until(lambda: all(os.path.exists(f"{marker}{r}") for r in range(2)), 30)
        assert [m.name for m in persistent_meshes() if m.running] == ["sshkeep"]
        mesh = attach("sshkeep")
        assert trained, _why_not_trained(mesh)
        assert [s.pid for s in mesh.status()] == pids
        assert sorted(mesh.pull("w").values()) == [100, 101]
        [fit] = mesh.detached_results
        assert fit.label == "fit" and fit.values == {0: "trained", 1: "trained"}, fit
        assert "step 2" in fit.output[1]
        reduced = mesh.run("t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nt.item()")
        assert list(reduced.values()) == [3.0, 3.0]  # across the two hosts, in the group made before the kill
        # one kernel at a time: another is refused, naming this one, then takes it over
        other = subprocess.run([sys.executable, "-c", TAKER], capture_output=True, text=True, timeout=60)
        assert f"held by another kernel (pid {os.getpid()}" in other.stdout, (other.stdout, other.stderr)
        assert "took it: [100, 101]" in other.stdout, (other.stdout, other.stderr)
        with pytest.raises(Exception, match="taken over by pid"):
            mesh.run("1")
        mesh = attach("sshkeep")  # (the taker ended: the mesh waits for the next kernel again)
        assert [s.pid for s in mesh.status()] == pids
    finally:
        if mesh is not None:
            mesh.shutdown()
        if first.poll() is None:
            first.kill()
        for pid in _agents_running("host-0") + _agents_running("host-1"):
            os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not _agents_running("host-0") and not _agents_running("host-1"), 15)
    assert not persistent_meshes()
