"""Put, get and sync write through partial files with predictable names: never through a planted
link, private until complete, and with the source's mode at the end (review N3, N9)."""

import os
import socket
import stat

import pytest

from monarch_kernel import local_mesh
from monarch_kernel.agent import files


@pytest.fixture(scope="module")
def mesh():
    with local_mesh(gpus=1, dist="none", name="transfer-safety") as m:
        yield m


def _shared_folder(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a team folder: anyone may write, not sticky
    return shared


def test_a_link_planted_at_the_partial_name_is_not_written_through(mesh, tmp_path):
    """N3: the put opened DST.monarch-partial-HOST with open(..., "wb"), following a link planted
    there: the victim's file was overwritten, re-moded, and the link moved into place as DST."""
    victim = tmp_path / "authorized_keys"
    victim.write_text("the victim's only key\n")
    victim.chmod(0o600)
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(1 << 20))
    dst = _shared_folder(tmp_path) / "weights.bin"
    partial = f"{dst}.monarch-partial-{socket.gethostname()}"
    os.symlink(victim, partial)
    report = mesh.put(str(src), str(dst))
    assert not report.errors, report.errors
    assert victim.read_text() == "the victim's only key\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not os.path.islink(dst) and dst.read_bytes() == src.read_bytes()


def test_an_interrupted_put_leaves_a_private_partial_and_a_planted_one_is_not_resumed(tmp_path):
    """N9: the partial was 0644 until the end, readable by anyone while the put stopped."""
    dst = str(_shared_folder(tmp_path) / "token.json")
    files.put_begin(dst, 100)
    files.put_chunk(dst, 0, b'{"token": "s3cr3t"}')  # ... and the put stops here
    partial = files._partial(dst)
    assert stat.S_IMODE(os.lstat(partial).st_mode) == 0o600
    os.unlink(partial)
    other = tmp_path / "elsewhere"
    other.write_bytes(b"x" * 50)
    os.symlink(other, partial)
    assert files.put_begin(dst, 100).partial == 0  # a link is nothing to resume from
    with pytest.raises(OSError):
        files.put_chunk(dst, 50, b"y" * 50)  # nor to write through
    assert other.read_bytes() == b"x" * 50


def test_get_keeps_the_mode_of_the_host_file(mesh, tmp_path):
    """N9: a 0600 file on the host landed 0644 (the umask) on the notebook's side."""
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("token")
    secret.chmod(0o600)
    script = tmp_path / "host" / "run.sh"
    script.write_text("echo hi")
    script.chmod(0o755)
    report = mesh.get(str(secret.parent), str(tmp_path / "back"))
    assert not report.errors, report.errors
    modes = {os.path.basename(f): stat.S_IMODE(os.stat(f).st_mode) for f in report.files}
    assert modes == {"secret.txt": 0o600, "run.sh": 0o755}


def _chown_if_root(path, uid):
    if os.geteuid() == 0:
        os.chown(path, uid, uid)


def test_a_workspace_copy_another_user_made_first_is_refused(tmp_path, monkeypatch):
    """N2: the agent adopted an existing NAME-HASH folder whoever owned it (the key is predictable):
    another user pre-created it under a shared root and planted a .pyc the ranks then imported."""
    from monarch_kernel.agent import workspace as agent_ws
    from monarch_kernel.core.workspace import ROOT_ENV, workspace_key

    root = tmp_path / "wsroot"
    root.mkdir()
    root.chmod(0o1777)  # a shared scratch folder, sticky as /tmp is
    monkeypatch.setenv(ROOT_ENV, str(root))
    key = workspace_key(str(tmp_path / "proj"))
    planted = root / key
    planted.mkdir()
    planted.chmod(0o777)  # made first by someone else, open to all
    _chown_if_root(planted, 65534)
    with pytest.raises(PermissionError, match="another user could plant code"):
        agent_ws.write_files(key, [("mod.py", 0o644, 0, 0, 3, b"x=1")], deletes=[])
    with pytest.raises(PermissionError):
        agent_ws.list_files(key)
    assert not (planted / "mod.py").exists()
    planted.rmdir()
    result = agent_ws.write_files(key, [("mod.py", 0o644, 0, 0, 3, b"x=1")], deletes=[])  # our own: fine
    assert result.written == 1 and stat.S_IMODE(os.lstat(planted).st_mode) == 0o700


def test_a_world_writable_root_that_is_not_sticky_is_refused(tmp_path, monkeypatch):
    from monarch_kernel.agent import workspace as agent_ws
    from monarch_kernel.core.workspace import ROOT_ENV

    root = tmp_path / "open-root"
    root.mkdir()
    root.chmod(0o777)  # anyone may rename our copy away and put theirs in its place
    monkeypatch.setenv(ROOT_ENV, str(root))
    with pytest.raises(PermissionError, match="not sticky"):
        agent_ws.write_files("proj-0123456789ab", [("mod.py", 0o644, 0, 0, 3, b"x=1")], deletes=[])


def test_a_filesystem_marker_another_user_planted_is_not_believed(tmp_path, monkeypatch):
    """N2: a planted .monarch-fsid made hosts look as if they shared a disk: they received nothing."""
    from monarch_kernel.agent import workspace as agent_ws
    from monarch_kernel.core.workspace import ROOT_ENV

    root = tmp_path / "wsroot"
    root.mkdir()
    root.chmod(0o1777)
    monkeypatch.setenv(ROOT_ENV, str(root))
    marker = root / f".monarch-fsid-{os.getuid()}"
    marker.write_text("the-id-of-another-disk")
    marker.chmod(0o666)  # writable by others: not a marker of ours
    assert agent_ws.filesystem_id() != "the-id-of-another-disk"
    marker.chmod(0o600)
    assert agent_ws.filesystem_id() == "the-id-of-another-disk"
