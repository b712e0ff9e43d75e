"""The mesh view: a grid of ranks with state and load; the live widget follows changes."""

import os
import signal
import time

import pytest
from conftest import wait_until

from monarch_kernel import local_mesh
from monarch_kernel.views.meshview import MeshView, mesh_snapshot, snapshot_rich, snapshot_text
from monarch_kernel.views.widgets import MeshWidget


@pytest.fixture(scope="module")
def mesh():
    m = local_mesh(gpus=4, dist="none", name=f"view-{os.getpid()}")
    yield m
    m.shutdown()


def test_snapshot_grid_has_hosts_down_and_gpus_across(mesh):
    snap = mesh_snapshot(mesh)
    assert snap.col_labels == ("GPU 0", "GPU 1", "GPU 2", "GPU 3") and snap.row_labels == ("localhost",)
    assert [c.rank for c in snap.rows[0]] == [0, 1, 2, 3]
    assert {c.state for c in snap.cells()} == {"idle"} and all(c.pid for c in snap.cells())
    assert not snap.has_gpu  # no GPU here: the GPU column is absent, not an error


def test_load_arrives_from_the_host_agent(mesh):
    mesh.run("import time\nend = time.time() + 1.5\nwhile time.time() < end: pass")
    assert wait_until(lambda: all(c.cpu_percent is not None for c in mesh_snapshot(mesh).cells()), 3)
    cells = mesh_snapshot(mesh).cells()
    assert all(c.rss_bytes > 10 << 20 for c in cells)
    assert "cpu " in snapshot_text(mesh_snapshot(mesh)) and "rss " in snapshot_text(mesh_snapshot(mesh))


def test_one_dim_and_three_dim_shapes(mesh):
    line = mesh.select_ranks([0, 2, 3])
    snap = mesh_snapshot(line)
    assert snap.col_labels == ("ranks=0", "ranks=1", "ranks=2") and len(snap.rows) == 1
    from monarch_kernel.api.mesh import Mesh
    from monarch_kernel.core.shape import Shape

    cube = Mesh(mesh._runtime, Shape((("a", 2), ("b", 1), ("c", 2)), (0, 1, 2, 3)))
    snap = mesh_snapshot(cube)
    assert snap.row_labels == ("a=0, b=0", "a=1, b=0") and snap.col_labels == ("c=0", "c=1")
    assert [[c.rank for c in row] for row in snap.rows] == [[0, 1], [2, 3]]
    view = MeshView(mesh)
    bundle = view._repr_mimebundle_()
    assert bundle["text/html"].count("class='mk-rank'") == 4 and "rank 3" in bundle["text/plain"]
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(snapshot_rich(view.snapshot))
    assert "localhost:2 (rank 2)" in console.export_text()


def test_widget_follows_busy_idle_and_dead_within_a_second(mesh):
    widget = MeshWidget(mesh, refresh_s=0.2)
    try:
        def state(rank):
            return widget.cards[rank].value.split("data-state='")[1].split("'")[0]

        future = mesh.slice(gpus=1).run_async("import time\ntime.sleep(1.5)", name="nap")
        start = time.monotonic()
        assert wait_until(lambda: state(1) == "busy", 1.0), time.monotonic() - start
        assert "nap for" in widget.cards[1].value and state(0) == "idle"
        future.get()
        assert wait_until(lambda: state(1) == "idle", 1.0)
        widget.show_output(1)
        pid = mesh_snapshot(mesh).rows[0][3].pid
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: state(3) == "dead", 1.0)
        assert "killed by SIGKILL" in widget.cards[3].value
        assert "dead" in widget._repr_mimebundle_()["text/plain"]
    finally:
        widget.close()
        mesh.restart()


def test_a_rank_running_an_endpoint_shows_busy_with_its_name(mesh):
    import sys

    import cloudpickle

    from monarch_kernel import Actor, endpoint

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Napper(Actor):
        @endpoint
        def nap(self, seconds):
            time.sleep(seconds)

    nappers = mesh.spawn("nappers", Napper)
    future = nappers.slice(gpus=2).nap.call_one(2.5)
    try:
        assert wait_until(lambda: mesh_snapshot(mesh).rows[0][2].state == "busy", 2.0)
        assert "Napper.nap" in mesh_snapshot(mesh).rows[0][2].detail
        assert mesh_snapshot(mesh).rows[0][1].state == "idle"
        future.get(timeout=10)
        # the rank says at once that it is idle again (not at its next load report)
        assert wait_until(lambda: mesh_snapshot(mesh).rows[0][2].state == "idle", 0.3)
    finally:
        future.get(timeout=10)


def test_the_widget_sums_up_each_host_and_folds_hosts_when_there_are_many(mesh, monkeypatch):
    import monarch_kernel.views.widgets as widgets_module

    flat = MeshWidget(mesh, refresh_s=60)
    try:
        assert "4 ranks: 4 idle" in flat._summary.value and "4 idle" in flat._row_heads[0].value
    finally:
        flat.close()
    monkeypatch.setattr(widgets_module, "COLLAPSE_ROWS", 0)  # as with more hosts than fit: fold every host
    folded = MeshWidget(mesh, refresh_s=60)
    try:
        assert folded._folded is not None and folded._folded.get_title(0).startswith("localhost: 4 idle")
        assert folded._folded.selected_index is None and len(folded.cards) == 4
        future = mesh.slice(gpus=1).run_async("import time\ntime.sleep(1.0)", name="fold")
        assert wait_until(lambda: (folded.refresh(), folded._folded.get_title(0))[1].startswith("localhost: 3 idle, 1 busy"), 2)
        future.get()
    finally:
        folded.close()
