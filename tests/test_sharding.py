"""The sharding view: layouts built from each rank's metadata, drawn as text and HTML."""

import os
import re

import pytest

from monarch_kernel import local_mesh, visualize_sharding
from monarch_kernel.core.sharding import LocalPiece, Placement, TensorLayout
from monarch_kernel.views.shardview import ShardingView

SETUP = """
import os, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate, Partial, DTensor
from torch.distributed.fsdp import fully_shard
mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
mesh1d = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
rows_cols = distribute_tensor(torch.arange(30.).reshape(5, 6), mesh2d, [Shard(0), Shard(1)])
by_cols = distribute_tensor(torch.arange(32.).reshape(4, 8), mesh1d, [Shard(1)])
uneven = distribute_tensor(torch.arange(15.).reshape(5, 3), mesh1d, [Shard(0)])
replicated = distribute_tensor(torch.ones(4, 4), mesh2d, [Replicate(), Shard(1)])
partial = DTensor.from_local(torch.ones(2, 2), mesh2d, [Partial(), Replicate()])
cube = distribute_tensor(torch.ones(4, 6, 8), mesh2d, [Shard(2), Shard(0)])
per_rank = torch.ones(3) * (int(os.environ["RANK"]) % 2)
same = torch.ones(3)
model = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
fully_shard(model, mesh=mesh1d)
from torch.distributed.tensor.placement_types import _StridedShard
strided = DTensor.from_local(torch.ones(2, 4), mesh2d, [_StridedShard(0, split_factor=2), Shard(0)],
                             shape=torch.Size([8, 4]), stride=(4, 1))
"""


@pytest.fixture(scope="module")
def mesh():
    m = local_mesh(gpus=4, dist="gloo", name=f"sharding-{os.getpid()}")
    m.run(SETUP)
    yield m
    m.shutdown()


def extents(view):
    """rank -> (rows, cols) from the HTML blocks."""
    found = {}
    for ranks, rows, cols in re.findall(r"data-ranks='([\d,]*)' data-rows='(\d+:\d+)' data-cols='(\d+:\d+)'",
                                        view.html()):
        for r in ranks.split(","):
            found.setdefault(int(r), []).append((rows, cols))
    return found


def test_2d_mesh_shards_rows_and_cols(mesh):
    view = visualize_sharding(mesh, "rows_cols")
    assert extents(view) == {0: [("0:3", "0:3")], 1: [("0:3", "3:6")], 2: [("3:5", "0:3")], 3: [("3:5", "3:6")]}
    text = view.text()
    assert "DeviceMesh (dp=2, tp=2), placements (Shard(0), Shard(1))" in text
    assert "dim 0 [3:5]  localhost:2 (rank 2)  localhost:3 (rank 3)" in text
    assert "0: 36 B, 1: 36 B, 2: 24 B, 3: 24 B" in text


def test_1d_mesh_shard_on_columns(mesh):
    view = visualize_sharding(mesh, "by_cols")
    assert extents(view) == {r: [("0:4", f"{2 * r}:{2 * r + 2}")] for r in range(4)}


def test_uneven_rows_follow_chunk_semantics_and_mark_the_empty_shard(mesh):
    view = visualize_sharding(mesh, "uneven")
    assert extents(view) == {0: [("0:2", "0:3")], 1: [("2:4", "0:3")], 2: [("4:5", "0:3")]}
    assert "empty shards (no elements): localhost:3 (rank 3)" in view.text()
    assert [p.local_shape for p in view.layout.pieces] == [(2, 3), (2, 3), (1, 3), (0, 3)]


def test_replicate_puts_several_ranks_on_one_block(mesh):
    view = visualize_sharding(mesh, "replicated")
    assert extents(view) == {0: [("0:4", "0:2")], 2: [("0:4", "0:2")], 1: [("0:4", "2:4")], 3: [("0:4", "2:4")]}
    assert "ranks 0,2 (replicated)" in view.text()


def test_partial_is_marked_unreduced_not_replicated(mesh):
    view = visualize_sharding(mesh, "partial")
    assert view.layout.partial == (Placement("partial", reduce_op="sum"),)
    text = view.text()
    assert "Partial(sum)" in text and "unreduced" in text and "partial" in text.splitlines()[-2]
    page = view.html()
    assert "&Sigma; Partial(sum)" in page and "unreduced, Partial(sum)" in page  # on the block, and in its hover text


def test_3d_tensor_is_faceted_on_the_dim_not_drawn(mesh):
    view = visualize_sharding(mesh, "cube")
    text = view.text()
    assert "at dim 2 [0:4]:" in text and "at dim 2 [4:8]:" in text
    facets = view.layout.facets(0, 1)
    assert [view.layout.blocks(0, 1, f)[0][0].ranks for f in facets] == [(0,), (2,)]
    other = visualize_sharding(mesh, "cube", rows=2, cols=0)  # draw dims 2 x 0 instead
    assert extents(other)[3] == [("4:8", "2:4")]


def test_plain_tensors_compare_ranks_by_checksum(mesh):
    assert "values different across ranks" in visualize_sharding(mesh, "per_rank").text()
    same = visualize_sharding(mesh, "same")
    assert "values identical on every rank" in same.text()
    assert same.html().count("<tr>") == 5


def test_fsdp2_module_gives_a_parameter_table(mesh):
    view = visualize_sharding(mesh, "model")
    text = view.text()
    assert "module model: 4 parameters, 348 B over all ranks" in text
    assert re.search(r"0\.weight\s+\[6, 10\]\s+Shard\(0\)\s+0: 80 B, 1: 80 B, 2: 80 B, 3: 0 B\s+240 B", text)


def test_a_missing_name_is_a_readable_error(mesh):
    with pytest.raises(Exception, match="NameError"):
        visualize_sharding(mesh, "nothing_here")
    with pytest.raises(Exception, match="expected a torch.Tensor or DTensor"):
        visualize_sharding(mesh, "'text'")


def test_layout_model_without_a_mesh():
    pieces = tuple(LocalPiece(r, (n, 4), (start, 0), n * 16, "cpu", "float32")
                   for r, (start, n) in enumerate([(0, 2), (2, 2), (4, 1), (5, 0)]))
    layout = TensorLayout("t", (5, 4), "float32", pieces, (Placement("shard", 0),), (4,), ("x",))
    grid = layout.blocks(0, 1)
    assert [(b.rows, b.ranks) for line in grid for b in line] == [((0, 2), (0,)), ((2, 4), (1,)), ((4, 5), (2,))]
    assert [p.rank for p in layout.empty_pieces()] == [3]


def test_the_widget_redraws_other_dims_without_asking_the_ranks(mesh):
    from monarch_kernel.views.widgets import ShardingWidget

    widget = ShardingWidget(visualize_sharding(mesh, "cube"))
    assert widget._repr_mimebundle_()["text/plain"].startswith("DTensor cube")
    assert "data-rows='0:2' data-cols='0:6'" in widget.picture.value
    widget.cols.value = 2
    assert "data-rows='0:2' data-cols='0:4'" in widget.picture.value and "at dim 1 [0:6]" in widget.picture.value
    assert "dim 1 [0:6]" in widget.fallback_text


def test_strided_sharding_is_reported_clearly(mesh):
    text = visualize_sharding(mesh, "strided").text()
    assert "placements (StridedShard(0, split_factor=2), Shard(0))" in text
    assert "interleaved, not one range" in text


def test_each_block_says_its_global_slice_holders_and_bytes_on_hover():
    pieces = tuple(LocalPiece(r, (3, 8), (3 * r, 0), 96, "cpu", "float32") for r in range(2))
    view = ShardingView(TensorLayout("w", (6, 8), "float32", pieces, (Placement("shard", 0),), (2,), ("x",)))
    page = view.html()
    assert "title='w[3:6, 0:8]: rank 1, 96 B per holder'" in page


def test_a_description_reads_as_one_line_for_the_debuggers_variables():
    from monarch_kernel.core.sharding import TensorDescription

    plain = TensorDescription("tensor", 0, (2, 3), "float32", (2, 3), (0, 0), 24, "cpu")
    assert plain.summary() == "float32[2, 3] on cpu"
    piece = TensorDescription("dtensor", 1, (8, 4), "bfloat16", (4, 4), (4, 0), 32, "cuda:1",
                              placements=(("shard", 0, None, None), ("replicate", None, None, None)),
                              mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), mesh_coord=(1, 0))
    assert piece.summary() == ("bfloat16[8, 4] on cuda:1, this rank's piece [4, 4] at (4, 0); "
                               "Shard(0), Replicate() over mesh 2x2 (dp, tp)")


def test_a_real_dtensor_reads_as_one_line_on_its_rank(mesh):
    got = mesh.run("from monarch_kernel.rank.tensorinfo import describe_local\n"
                   "describe_local(rows_cols, int(os.environ['RANK']), checksum=False).summary()")
    assert got.by_rank()[3] == ("float32[5, 6] on cpu, this rank's piece [2, 3] at (3, 3); "
                                "Shard(0), Shard(1) over mesh 2x2 (dp, tp)"), got.by_rank()
