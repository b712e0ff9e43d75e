"""Multi-host meshes over real SSH: network namespaces, each with its own OpenSSH sshd."""

import sys
import time

import pytest

from sshhosts import SSHTestHosts, unavailable_reason
from test_dist import DDP_CELL

from monarch_kernel import MeshStartError, RemoteError, ssh_mesh

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    test_hosts = SSHTestHosts(2, str(tmp_path_factory.mktemp("ssh")))
    try:
        yield test_hosts.start()
    finally:
        test_hosts.stop()


def processes(test_hosts):
    """The processes now running in each test host."""
    return {h.alias: set(test_hosts.pids(h)) for h in test_hosts.hosts}


def back_to(test_hosts, baseline):
    """A check that nothing beyond `baseline` runs in any test host."""
    return lambda: all(now <= baseline[alias] for alias, now in processes(test_hosts).items())


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


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


def test_slices_by_host(mesh, sink):
    assert mesh.slice(hosts=1).pull("dist.get_rank()").by_rank() == {2: 2, 3: 3}
    vm = mesh.slice(hosts=slice(0, 2), gpus=1).run("import os\nos.environ['LOCAL_RANK']", sink=sink)
    assert vm.by_rank() == {1: "1", 3: "1"}


def test_ddp_across_hosts_gives_identical_parameters(mesh, sink):
    results = list(mesh.run(DDP_CELL, sink=sink, timeout=180).values())
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
    m = ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                 connect_options=hosts.connect_options(), name="ssh-cut")
    try:
        future = m.run_async("import time\ntime.sleep(60)", sink=sink)
        time.sleep(0.5)
        cut = time.monotonic()
        hosts.cut_link(hosts.hosts[1])
        with pytest.raises(RemoteError) as info:
            future.get(timeout=20)
        assert time.monotonic() - cut < 6
        lost = [f for f in info.value.failures if f.rank == 1][0]
        assert "host-1" in lost.message and "lost" in lost.message
        assert m.status()[1].state == "dead"
        # the agent on the cut-off host notices the silence and takes its rank down
        assert wait_until(lambda: processes(hosts)["host-1"] <= baseline["host-1"], 12)
    finally:
        hosts.restore_link(hosts.hosts[1])
        m.interrupt()
        m.shutdown()
