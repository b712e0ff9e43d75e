"""Hostile or mistaken input at the API's doors: each gets a clear error and starts nothing.

Frames are covered in test_bad_frames.py, comm messages in test_sidebar.py and forged
shared-memory references in test_faults.py; this list covers what a user (or a config
file) types: mesh names, env keys, host names, addresses and shapes.
"""

import pytest

from monarch_kernel import MeshUsageError, local_mesh, ssh_mesh
from monarch_kernel.controller.ssh import SSHTarget


@pytest.mark.parametrize("name", ["evil/m", "../up", "a b", "x" * 65, "tab\tname", "nul\x00", "ünïcode"])
def test_hostile_mesh_names_are_refused(name):
    with pytest.raises(MeshUsageError, match="mesh name"):
        local_mesh(gpus=1, dist="none", name=name)


@pytest.mark.parametrize("key", ["X$(id>/tmp/f)", "1ABC", "A B", "A=B", "", "A;B", "A\nB"])
def test_env_keys_that_are_not_variable_names_are_refused(key):
    with pytest.raises(MeshUsageError, match="not variable names"):
        local_mesh(gpus=1, dist="none", env={key: "1"})


@pytest.mark.parametrize("address", ["", "0.0.0.0", "::", "*"])
def test_master_addresses_that_name_every_interface_are_refused(address):
    with pytest.raises(MeshUsageError, match="master_addr"):
        ssh_mesh(["somehost"], gpus=1, dist="gloo", master_addr=address)


@pytest.mark.parametrize("gpus", [0, -1, 1.5, "4"])
def test_shapes_that_are_not_positive_counts_are_refused(gpus):
    with pytest.raises(MeshUsageError, match="gpus="):
        local_mesh(gpus=gpus, dist="none")


@pytest.mark.parametrize("dist", ["mpi", "", "GLOO;rm"])
def test_unknown_backends_are_refused(dist):
    with pytest.raises(MeshUsageError, match="dist="):
        local_mesh(gpus=1, dist=dist)


@pytest.mark.parametrize("text", ["", "user@", "host:", "host:22x", "[::1", "[::1]x", "[host]:22", "[::1]:"])
def test_malformed_ssh_targets_are_refused(text):
    with pytest.raises(ValueError, match="bad SSH host"):
        SSHTarget.parse(text)


@pytest.mark.parametrize("text, target", [
    ("host", SSHTarget("host")),
    ("me@host:2222", SSHTarget("host", "me", 2222)),
    ("::1", SSHTarget("::1")),
    ("me@fe80::1", SSHTarget("fe80::1", "me")),
    ("[::1]:2222", SSHTarget("::1", None, 2222)),
    ("me@[2001:db8::5]", SSHTarget("2001:db8::5", "me")),
])
def test_ssh_targets_parse_including_ipv6(text, target):
    """F27: IPv6 literals were refused."""
    assert SSHTarget.parse(text) == target
    assert SSHTarget.parse(str(target)) == target


def test_an_ssh_config_that_turns_host_key_checks_off_is_refused(tmp_path):
    """F8: `UserKnownHostsFile none` in the user's SSH config silently accepted any host key."""
    from monarch_kernel import MeshStartError

    config = tmp_path / "ssh_config"
    config.write_text("Host lab\n  HostName 198.18.0.250\n  UserKnownHostsFile none\n")
    with pytest.raises(MeshStartError, match="UserKnownHostsFile none"):
        ssh_mesh(["lab"], gpus=1, dist="none", connect_options={"config": [str(config)]}, timeout=10)


def test_a_rank_that_cannot_start_says_why_in_the_start_error():
    """A rank whose set-up raises (here: an environment value with a NUL byte, which the OS cannot take) ends with
    exit code 70; the start error carries its traceback's last line (before, only "exit code 70")."""
    from monarch_kernel import MeshStartError

    with pytest.raises(MeshStartError, match=r"(?s)exited during start-up \(exit code 70\).*could not start.*"
                                             r"ValueError: embedded null byte"):
        local_mesh(gpus=1, dist="none", rank_env=[{"SETTING": "a\0b"}], timeout=60)
