import pytest

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.shape import Shape, parse_spec

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def test_grid_points_are_row_major():
    shape = Shape.grid(hosts=2, gpus=3)
    points = list(shape.points())
    assert [p.rank for p in points] == [0, 1, 2, 3, 4, 5]
    assert dict(points[4]) == {"hosts": 1, "gpus": 1}
    assert str(shape) == "{hosts: 2, gpus: 3}"
    assert shape.sizes == {"hosts": 2, "gpus": 3}


def test_int_selector_drops_the_dim():
    sub = Shape.grid(hosts=2, gpus=4).slice(hosts=1)
    assert sub.names == ("gpus",)
    assert sub.ranks == (4, 5, 6, 7)


def test_slice_and_list_keep_the_dim_renumbered():
    shape = Shape.grid(hosts=2, gpus=4)
    sub = shape.slice(hosts=slice(0, 2), gpus=slice(None, None, 2))
    assert sub.dims == (("hosts", 2), ("gpus", 2))
    assert sub.ranks == (0, 2, 4, 6)
    assert shape.slice(gpus=[3, 1]).ranks == (3, 1, 7, 5)
    assert sub.slice(gpus=1).ranks == (2, 6)


def test_negative_index_and_index_of():
    shape = Shape.grid(hosts=1, gpus=4)
    assert shape.slice(gpus=-1).ranks == (3,)
    assert shape.index_of(hosts=0, gpus=2) == 2


@pytest.mark.parametrize("bad", [dict(gpus=4), dict(gpus=slice(5, 9)), dict(gpus=[0, 9]), dict(nodes=0),
                                 dict(gpus=True), dict(gpus=[])])
def test_bad_selectors_say_what_is_wrong(bad):
    with pytest.raises(MeshUsageError) as info:
        Shape.grid(hosts=1, gpus=4).slice(**bad)
    assert "gpus" in str(info.value) or "nodes" in str(info.value)


def test_index_of_requires_every_dim():
    with pytest.raises(MeshUsageError, match="hosts=0, gpus=0"):
        Shape.grid(hosts=1, gpus=4).index_of(gpus=1)


def test_select_ranks():
    shape = Shape.grid(hosts=1, gpus=4)
    assert shape.select_ranks([0, 2]).dims == (("ranks", 2),)
    with pytest.raises(MeshUsageError, match="not in this mesh"):
        shape.select_ranks([7])


@pytest.mark.parametrize("text,expected", [("2", 2), ("0,2", [0, 2]), ("0:4", slice(0, 4)),
                                           ("::2", slice(None, None, 2)), ("1:", slice(1, None))])
def test_parse_spec(text, expected):
    assert parse_spec(text) == expected


@pytest.mark.parametrize("text", ["a", "1:2:3:4", "1.5"])
def test_parse_spec_rejects_garbage(text):
    with pytest.raises(MeshUsageError, match="bad selector"):
        parse_spec(text)


def test_format_ranks():
    assert format_ranks([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"
    assert format_ranks([4]) == "4"
    assert format_ranks([]) == ""


def test_an_extent_is_monarchs_mapping_and_still_equals_our_sizes_dict():
    import pickle

    from monarch_kernel.core.shape import Extent, MeshShaped

    class Handle(MeshShaped):
        def __init__(self, shape):
            self.shape = shape

    extent = Handle(Shape.grid(hosts=2, gpus=3)).extent
    assert (extent.labels, extent.sizes, extent.nelements, str(extent)) == (["hosts", "gpus"], [2, 3], 6,
                                                                           "{hosts: 2, gpus: 3}")
    assert extent == {"hosts": 2, "gpus": 3} and extent != {"hosts": 2}  # (what our API always answered)
    assert extent != Extent(["gpus", "hosts"], [3, 2])  # between extents the order counts, as in Monarch's
    assert pickle.loads(pickle.dumps(extent)) == extent
    point = next(iter(Shape.grid(hosts=2, gpus=3).points()))
    assert point.extent == extent and str(point) == "{'hosts': 0/2, 'gpus': 0/3}"
    with pytest.raises(ValueError, match="2 labels but 1 sizes"):
        Extent(["a", "b"], [1])
    with pytest.raises(TypeError):
        hash(extent)
