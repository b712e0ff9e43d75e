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
    "RemoteError", "SerializationError", "Shape", "SupervisionError", "ValueMesh", "load_ipython_extension", "local_mesh",
    "plan", "ray_mesh", "slurm_mesh", "ssh_mesh", "unload_ipython_extension", "attach", "persistent_meshes", "stop_persistent"}


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


def test_the_session_installs_and_closes_once_whatever_calls_it_twice():
    """The notebook's session: hooks in and out together, and its close shuts every open mesh and
    the controller's loop (again: nothing happens), after which a new mesh starts on a fresh loop."""
    from monarch_kernel import local_mesh
    from monarch_kernel.actors import procs
    from monarch_kernel.api import sinks
    from monarch_kernel.api.session import NotebookHooks, Session
    from monarch_kernel.controller.loop import ControllerLoop

    session = Session.current()
    adopted = []
    session.install(NotebookHooks(sink_factory=lambda options: sinks.PlainSink(), adopt_mesh=adopted.append))
    assert session.installed and adopted.append in procs.mesh_started
    session.uninstall()
    session.uninstall()
    assert not session.installed and adopted.append not in procs.mesh_started
    mesh = local_mesh(gpus=1, dist="none", name="session-close")
    kept = session.of_mesh(mesh._runtime, list, list)  # a mesh's notebook-side state lives in the session
    assert session.of_mesh(mesh._runtime, list, list) is kept
    loop = ControllerLoop.get()
    session.close()
    session.close()
    assert mesh.closed and not loop.thread.is_alive()
    with local_mesh(gpus=1, dist="none", name="session-after") as again:
        assert again.run("1 + 1").by_rank() == {0: 2}
        assert ControllerLoop.get() is not loop
