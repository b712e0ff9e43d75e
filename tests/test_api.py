"""The public surface: names, docstrings, and what `import monarch_kernel` costs."""

import subprocess
import sys

import monarch_kernel

PUBLIC = {
    "Accelerator", "Actor", "ActorDeadlockError", "ActorDiedError", "ActorError", "ActorFailureEvent", "ActorFuture", "ActorMesh",
    "current_rank", "endpoint", "visualize_sharding",
    "Candidate", "CellSyntaxError", "HealthTimings", "Mesh", "MeshError", "MeshFuture", "MeshInterrupted", "MeshNotRunningError",
    "MeshBusyError", "MeshStartError", "MeshTimeoutError", "MeshUsageError", "MonarchWarning", "Plan", "Point",
    "RankDiedError", "RankFailure",
    "RemoteError", "SerializationError", "Shape", "ValueMesh", "load_ipython_extension", "local_mesh",
    "plan", "slurm_mesh", "ssh_mesh", "unload_ipython_extension"}


def test_public_names():
    assert set(monarch_kernel.__all__) == PUBLIC
    for name in monarch_kernel.__all__:
        assert getattr(monarch_kernel, name).__doc__, name


def test_unknown_names_raise_attribute_error():
    try:
        monarch_kernel.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_importing_the_package_loads_nothing_else():
    code = "import sys, monarch_kernel\nprint(sorted(m for m in sys.modules if m.startswith('monarch_kernel')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['monarch_kernel']"
