"""Workspace sync and autoreload: the user's project on every host (SSH test hosts, each with its own copy)."""

import os
import sys
import time

import pytest
from conftest import RecordingSink
from sshhosts import SSHTestHosts, unavailable_reason

import monarch_kernel
from monarch_kernel import MeshUsageError, RemoteError, local_mesh, ssh_mesh
from monarch_kernel.core.workspace import workspace_key

needs_hosts = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    # host-1's workspace folder is a small disk of its own (a full disk on one host)
    with SSHTestHosts(2, str(tmp_path_factory.mktemp("wshosts")), workspace_quota={1: 8 << 20}) as test_hosts:
        yield test_hosts


@pytest.fixture(scope="module")
def mesh(hosts):
    m = ssh_mesh([h.alias for h in hosts.hosts], gpus=2, dist="none", python=sys.executable,
                 connect_options=hosts.connect_options(), name="ws-test")
    hosts.mesh_for_listing = m
    try:
        yield m
    finally:
        m.shutdown()


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def later(path, seconds=5):
    """Move a file's mtime forward (an edit within the same clock tick must still count as one)."""
    stamp = time.time() + seconds
    os.utime(path, (stamp, stamp))


def copy_on(hosts, host, folder):
    """The files of host's copy of folder, relative to it, as the host itself sees them (host-1's is its own disk)."""
    root = os.path.join(hosts.workspaces(host), workspace_key(str(folder)))
    listing = hosts.mesh_for_listing.slice(hosts=hosts.hosts.index(host)).run(
        f"import os\nsorted(os.path.relpath(os.path.join(d, n), {root!r}) for d, _, names in os.walk({root!r}) "
        "for n in names)", sink=RecordingSink())
    return next(iter(listing.values()))


def values(result):
    return list(result.values())


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    write(root / "wsdemo_pkg" / "__init__.py", "from wsdemo_pkg.model import Thing\n")
    write(root / "wsdemo_pkg" / "model.py", "class Thing:\n    def value(self):\n        return 1\n")
    write(root / "train.py", "print('train')\n")
    return root


@needs_hosts
def test_a_synced_package_imports_on_every_rank_of_both_hosts_from_its_own_copy(mesh, hosts, project):
    with pytest.raises(RemoteError, match="No module named 'wsdemo_pkg'"):
        mesh.run("import wsdemo_pkg", sink=RecordingSink())
    report = mesh.sync_workspace(str(project))
    assert [h.sent_files for h in report.hosts] == [3, 3] and not report.errors
    for host in hosts.hosts:
        assert copy_on(hosts, host, project) == ["train.py", "wsdemo_pkg/__init__.py", "wsdemo_pkg/model.py"]
    where = mesh.run("import wsdemo_pkg, socket\nwsdemo_pkg.__file__", sink=RecordingSink())
    for rank, path in where.by_rank().items():
        host = hosts.hosts[rank // 2]
        assert path.startswith(hosts.workspaces(host) + "/")  # each host imports its own copy
    assert set(values(mesh.run("wsdemo_pkg.Thing().value()", sink=RecordingSink()))) == {1}


@needs_hosts
def test_only_changes_travel_and_deleted_files_disappear(mesh, hosts, project):
    mesh.sync_workspace(str(project))
    again = mesh.sync_workspace(str(project))
    assert again.sent_bytes == 0 and [h.sent_files for h in again.hosts] == [0, 0]
    model = project / "wsdemo_pkg" / "model.py"
    write(model, "class Thing:\n    def value(self):\n        return 22\n")
    later(model)
    edited = mesh.sync_workspace(str(project))
    assert [h.sent_files for h in edited.hosts] == [1, 1]
    assert edited.sent_bytes == 2 * model.stat().st_size
    later(project / "train.py", 10)  # touched, not changed: compared by hash, not sent
    touched = mesh.sync_workspace(str(project))
    assert touched.sent_bytes == 0 and [h.unchanged for h in touched.hosts] == [3, 3]
    os.unlink(project / "train.py")
    gone = mesh.sync_workspace(str(project))
    assert [h.deleted for h in gone.hosts] == [1, 1]
    for host in hosts.hosts:
        assert "train.py" not in copy_on(hosts, host, project)


@needs_hosts
def test_gitignore_excludes_and_symlinks(mesh, hosts, project, tmp_path):
    write(project / ".gitignore", "data/\n*.log\n!keep.log\n")
    write(project / "data" / "big.bin", "x" * 1000)
    write(project / "run.log", "noise")
    write(project / "keep.log", "kept")
    write(project / "secret.key", "no")
    write(project / "notes" / "a.txt", "a")
    write(tmp_path / "outside.txt", "outside")
    os.symlink(tmp_path / "outside.txt", project / "outside-link.txt")
    os.symlink(project, project / "notes" / "loop")
    os.symlink(project / "notes" / "a.txt", project / "inside-link.txt")
    report = mesh.sync_workspace(str(project), exclude=["secret*"])
    assert sorted(report.skipped_links) == ["notes/loop", "outside-link.txt"]
    files = copy_on(hosts, hosts.hosts[0], project)
    assert files == [".gitignore", "inside-link.txt", "keep.log", "notes/a.txt", "train.py",
                     "wsdemo_pkg/__init__.py", "wsdemo_pkg/model.py"]
    copy = os.path.join(hosts.workspaces(hosts.hosts[0]), workspace_key(str(project)))
    assert open(os.path.join(copy, "inside-link.txt")).read() == "a"
    # what the folder leaves out is the host's own: a sync never deletes it there
    write(os.path.join(copy, "data", "results.csv"), "host data")
    write(os.path.join(copy, "__pycache__", "x.pyc"), "cache")
    assert [h.deleted for h in mesh.sync_workspace(str(project), exclude=["secret*"]).hosts] == [0, 0]
    assert os.path.exists(os.path.join(copy, "data", "results.csv"))


@needs_hosts
def test_modes_are_kept_and_a_big_folder_is_refused_naming_its_largest_files(mesh, hosts, project):
    script = project / "tool.sh"
    write(script, "#!/bin/sh\necho hi\n")
    os.chmod(script, 0o750)
    write(project / "weights.bin", "w" * 300_000)
    with pytest.raises(MeshUsageError, match=r"(?s)over the .* guard.*weights\.bin \(300\.0 kB\)"):
        mesh.sync_workspace(str(project), max_bytes=100_000)
    mesh.sync_workspace(str(project), max_bytes=100_000, force=True)
    copied = os.path.join(hosts.workspaces(hosts.hosts[0]), workspace_key(str(project)), "tool.sh")
    assert os.stat(copied).st_mode & 0o777 == 0o750
    with pytest.raises(MeshUsageError, match="not a folder"):
        mesh.sync_workspace(str(project / "missing"))


@needs_hosts
def test_auto_sync_and_autoreload_change_code_without_a_restart(mesh, project):
    sink = RecordingSink()
    # the ranks outlive each test's project folder: forget the package an earlier test imported
    mesh.run("import sys\nfor k in [k for k in sys.modules if k.startswith('wsdemo_pkg')]: del sys.modules[k]",
             sink=sink)
    mesh.sync_workspace(str(project), auto=True)
    mesh.autoreload(True)
    try:
        mesh.run("import wsdemo_pkg\nthing = wsdemo_pkg.Thing()", sink=sink)
        model = project / "wsdemo_pkg" / "model.py"
        write(model, "class Thing:\n    def value(self):\n        return 2\n\n    def extra(self):\n        return 'new'\n")
        later(model, 20)
        # the edit travels before the cell, and the object made before it sees the new methods
        assert set(values(mesh.run("(thing.value(), thing.extra())", sink=sink))) == {(2, "new")}
        write(model, "class Thing:\n    def value(self:\n        return 3\n")
        later(model, 30)
        broken = RecordingSink()
        assert set(values(mesh.run("thing.value()", sink=broken))) == {2}  # the old code keeps running
        text = "".join(broken.text("stderr").values())
        assert "failed to reload" in text and "model.py" in text and "SyntaxError" in text
        write(model, "class Thing:\n    def value(self):\n        return 4\n")
        later(model, 40)
        assert set(values(mesh.run("thing.value()", sink=sink))) == {4}
    finally:
        mesh.autoreload(False)
        mesh.sync_workspace(str(project), auto=False)


@needs_hosts
def test_a_restart_keeps_the_workspace_on_the_fresh_ranks(mesh, project):
    mesh.sync_workspace(str(project))
    mesh.restart()
    assert set(values(mesh.run("import wsdemo_pkg\nwsdemo_pkg.Thing().value() > 0", sink=RecordingSink()))) == {True}


def test_a_local_mesh_shares_the_folder_and_copies_nothing(project, capsys):
    with local_mesh(2, dist="none", name="ws-local") as mesh:
        report = mesh.sync_workspace(str(project), chdir=True)
        assert report.hosts == [] and report.shared_hosts == ["localhost"]
        assert "shares this filesystem: nothing copied" in capsys.readouterr().out
        where = mesh.run("import os, wsdemo_pkg\n(wsdemo_pkg.__file__, os.getcwd())", sink=RecordingSink())
        assert set(values(where)) == {(str(project / "wsdemo_pkg" / "__init__.py"), str(project))}


def test_the_sync_and_autoreload_magics(project):
    from conftest import ipython_shell as get_ipython
    from IPython.utils.capture import capture_output

    ip = get_ipython()
    ip.run_line_magic("load_ext", "monarch_kernel")
    try:
        ip.run_cell("%mesh up local --gpus 1 --dist none --name wsmagic")
        with capture_output() as cap:
            ip.run_cell(f"%mesh sync {project} --exclude '*.py' --auto")
            ip.run_cell("%mesh autoreload on")
        assert "shares this filesystem" in cap.stdout and "autoreload of synced modules on the ranks: on" in cap.stdout
    finally:
        ip.run_cell("%mesh down wsmagic")
        ip.run_line_magic("unload_ext", "monarch_kernel")


def sha256_of(path):
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "weights.bin"
    with open(path, "wb") as f:
        for _ in range(25):
            f.write(os.urandom(8 << 20))  # 200 MiB
    return path


@needs_hosts
def test_put_and_get_a_200_mb_file_with_checksums_on_each_host(mesh, hosts, big_file, tmp_path):
    target = f"{hosts.scratch}/ckpt/weights.bin"
    report = mesh.put(str(big_file), target)
    assert not report.errors and report.files == [target, target] and report.bytes_moved == 2 * big_file.stat().st_size
    assert not os.path.exists(target)  # each host has its own scratch; this machine's view is empty
    here = sha256_of(big_file)
    sums = mesh.run(f"import hashlib\nhashlib.sha256(open({target!r}, 'rb').read()).hexdigest()", sink=RecordingSink())
    assert set(values(sums)) == {here}
    got = mesh.get(target, str(tmp_path / "back"))
    assert sorted(os.listdir(tmp_path / "back")) == ["weights.bin.host-0", "weights.bin.host-1"]
    assert all(sha256_of(tmp_path / "back" / name) == here for name in os.listdir(tmp_path / "back"))
    assert not got.errors


@needs_hosts
def test_an_interrupted_get_goes_on_from_where_it_stopped(mesh, hosts, tmp_path):
    import signal
    import threading

    big_file = tmp_path / "larger.bin"  # large enough that the stop lands well inside the transfer
    with open(big_file, "wb") as f:
        for _ in range(64):
            f.write(os.urandom(8 << 20))  # 512 MiB
    target = f"{hosts.scratch}/resume/weights.bin"
    one = mesh.slice(hosts=1)
    assert [r.host for r in one.put(str(big_file), target).results] == ["host-1"]  # a slice's hosts only
    back = tmp_path / "back"
    partial = back / "weights.bin.host-1.monarch-partial"
    finished = threading.Event()

    def stop_when_started():  # the stop button, once some of the file has arrived
        while not finished.is_set():
            if partial.exists() and partial.stat().st_size >= 16 << 20:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.002)

    stopper = threading.Thread(target=stop_when_started, daemon=True)
    stopper.start()
    try:
        with pytest.raises(monarch_kernel.MeshInterrupted, match="stopped"):
            one.get(target, str(back))
    finally:
        finished.set()
        stopper.join(5)
    left = partial.stat().st_size
    assert 0 < left < big_file.stat().st_size
    resumed = one.get(target, str(back))
    assert resumed.results[0].bytes_resumed > 0
    assert resumed.bytes_moved == big_file.stat().st_size - resumed.results[0].bytes_resumed
    assert sha256_of(back / "weights.bin.host-1") == sha256_of(big_file) and not partial.exists()
    # a partial file that is not a prefix of the real one is not trusted: the get starts over
    with open(partial, "wb") as f:
        f.write(os.urandom(1 << 20))
    os.unlink(back / "weights.bin.host-1")
    again = one.get(target, str(back))
    assert again.results[0].bytes_resumed == 0 and sha256_of(back / "weights.bin.host-1") == sha256_of(big_file)


@needs_hosts
def test_per_rank_paths_and_bad_paths(mesh, hosts, tmp_path):
    mesh.run(f"import os\nos.makedirs({hosts.scratch!r}, exist_ok=True)\n"
             f"open(os.path.join({hosts.scratch!r}, 'metrics-%s.json' % os.environ['RANK']), 'w').write(os.environ['RANK'])",
             sink=RecordingSink())
    report = mesh.get(f"{hosts.scratch}/metrics-{{rank}}.json", str(tmp_path / "m"))
    names = sorted(os.listdir(tmp_path / "m"))
    assert names == [f"metrics-{r}.json.rank-{r}" for r in range(4)] and not report.errors
    assert (tmp_path / "m" / "metrics-3.json.rank-3").read_text() == "3"
    with pytest.raises(MeshUsageError, match="absolute path"):
        mesh.put(str(tmp_path), "relative/dst")
    with pytest.raises(MeshUsageError, match="no such file"):
        mesh.put(str(tmp_path / "nope"), "/tmp/x")
    missing = mesh.get(f"{hosts.scratch}/nothing-here", str(tmp_path / "m"))
    assert len(missing.errors) == 2 and "No such file" in missing.errors[0]


@needs_hosts
def test_a_full_disk_on_one_host_is_named_and_the_other_host_stays_in_sync(mesh, hosts, project):
    big = project / "data.bin"
    with open(big, "wb") as f:
        f.write(os.urandom(12 << 20))  # more than host-1's 8 MiB disk holds
    report = mesh.sync_workspace(str(project), force=True)
    assert report.errors and all(e.startswith("host-1: data.bin") for e in report.errors)
    assert "No space left on device" in report.errors[0]
    assert "data.bin" in copy_on(hosts, hosts.hosts[0], project)
    os.unlink(big)  # room again: the next sync brings host-1 level and clears what it left
    healed = mesh.sync_workspace(str(project))
    assert not healed.errors and copy_on(hosts, hosts.hosts[1], project) == copy_on(hosts, hosts.hosts[0], project)


@needs_hosts
def test_another_cloudpickle_on_a_host_is_warned_at_up_and_by_env(hosts, tmp_path, capsys):
    old = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "old-cloudpickle")
    if not os.path.isdir(os.path.join(old, "cloudpickle")):
        pytest.skip("scripts/test.sh installs cloudpickle 3.0.0 into .cache/old-cloudpickle")
    python = tmp_path / "python-with-old-cloudpickle"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={old} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    with ssh_mesh([hosts.hosts[0].alias], gpus=1, dist="none", python=str(python),
                  connect_options=hosts.connect_options(), name="ws-old") as mesh:
        assert "host-0 has cloudpickle 3.0.0, the notebook" in capsys.readouterr().err
        report = mesh.environment()
        assert report.hosts["host-0"]["cloudpickle"] == "3.0.0" and len(report.mismatches) == 1
        assert "warning: host-0 has cloudpickle 3.0.0" in report.text()
        assert set(values(mesh.run("1 + 1", sink=RecordingSink()))) == {2}  # it still works


@needs_hosts
def test_a_value_whose_module_is_missing_on_the_ranks_says_which_and_suggests_sync(mesh, tmp_path, monkeypatch):
    write(tmp_path / "onlyhere" / "onlyhere_mod.py", "class Box:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "onlyhere"))
    import onlyhere_mod

    with pytest.raises(Exception, match=r"(?s)needs module 'onlyhere_mod'.*%mesh sync"):
        mesh.push(box=onlyhere_mod.Box())
    assert mesh.environment().mismatches == []


@needs_hosts
def test_the_workspace_notebook_runs_end_to_end_on_the_test_hosts(hosts, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "07_workspace.ipynb")
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, HOME=hosts.install_home(str(tmp_path)), MONARCH_SSH_HOSTS="host-0 host-1",
               MONARCH_SSH_GPUS="1", MONARCH_SSH_DIST="gloo", MONARCH_SSH_PYTHON=sys.executable,
               MONARCH_SCRATCH=f"{hosts.scratch}/nb")
    NotebookClient(nb, timeout=300, kernel_name="python3").execute(env=env)
    texts = ["\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in c.outputs)
             for c in nb.cells if c.cell_type == "code"]
    assert any("2 hosts: 1 file" in t and "sent to each" in t for t in texts), texts
    assert any("[0-1] " in t and "TinyNet with 10 parameters" in t for t in texts), texts  # (one hostname here)
    assert any("[0-1] TinyNet (edited) with 10 parameters has checksum: True" in t for t in texts), texts
    assert any("['net-0.pt.rank-0', 'net-1.pt.rank-1']" in t for t in texts), "\n---\n".join(texts)
    assert any("every host matches the notebook" in t for t in texts)
    assert "is down" in texts[-1]


@needs_hosts
def test_hosts_that_share_a_disk_get_one_copy_written_once(hosts, project, tmp_path):
    shared_root = str(tmp_path / "nfs-home-cache")  # as a cluster whose home folders are one NFS share
    with ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                  connect_options=hosts.connect_options(), env={"MONARCH_KERNEL_WORKSPACE_ROOT": shared_root},
                  name="ws-shared") as shared:
        report = shared.sync_workspace(str(project))
        assert [h.shared_with for h in report.hosts] == ["", "host-0"] and not report.errors
        assert "host-1 shares host-0's disk: written once" in report.summary()
        assert report.sent_bytes == sum(f.stat().st_size for f in project.rglob("*") if f.is_file())
        assert set(values(shared.run("import wsdemo_pkg\nwsdemo_pkg.Thing().value()", sink=RecordingSink()))) == {1}


@needs_hosts
def test_a_file_that_changes_during_a_sync_is_named_and_the_rest_lands(mesh, project):
    from monarch_kernel.api import workspace as ws
    from monarch_kernel.controller.workspace_sync import scan

    found = scan(str(project))  # what the sync saw ...
    write(project / "train.py", "print('a longer training script than the one the scan saw')\n")  # ... then an edit
    entry = ws.SyncedFolder(str(project), (), False, False, ws.DEFAULT_MAX_BYTES)
    report = ws._sync_folder(mesh._runtime, entry, force=False, show=lambda _text: None, found=found)
    assert report.errors == [f"host-{i}: train.py: changed while syncing (it was written to meanwhile); sync again"
                             for i in (0, 1)]
    assert [h.sent_files for h in report.hosts] == [2, 2]  # the other files landed
    again = mesh.sync_workspace(str(project))
    assert not again.errors and [h.sent_files for h in again.hosts] == [1, 1]
