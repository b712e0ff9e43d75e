import pytest

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.values import ValueMesh

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def test_item_values_items():
    vm = ValueMesh(Shape.grid(hosts=1, gpus=4), [10, 11, 12, 13])
    assert vm.item(hosts=0, gpus=2) == 12
    assert list(vm.values()) == [10, 11, 12, 13]
    assert [(dict(p), p.rank, v) for p, v in vm.items()][1] == ({"hosts": 0, "gpus": 1}, 1, 11)
    assert vm.by_rank() == {0: 10, 1: 11, 2: 12, 3: 13}
    with pytest.raises(MeshUsageError):
        vm.item(hosts=0, gpus=7)


def test_repr_is_a_compact_grid():
    vm = ValueMesh(Shape.grid(hosts=1, gpus=4), [0, 1, 2, 3])
    assert repr(vm).splitlines() == [
        "ValueMesh({hosts: 1, gpus: 4})",
        "           gpus 0  gpus 1  gpus 2  gpus 3",
        "  hosts 0  0       1       2       3",
    ]


def test_repr_collapses_identical_values():
    vm = ValueMesh(Shape.grid(hosts=1, gpus=2), ["ok", "ok"])
    assert repr(vm) == "ValueMesh({hosts: 1, gpus: 2}, all ranks: 'ok')"


def test_html_has_one_cell_per_rank():
    vm = ValueMesh(Shape.grid(hosts=2, gpus=2), ["<a>", 1, 2, 3])
    html = vm._repr_html_()
    assert html.count("<td") == 4 and "&lt;a&gt;" in html and "rank 3" in html


def test_one_dim_repr_lists_ranks():
    vm = ValueMesh(Shape.grid(hosts=1, gpus=4).select_ranks([1, 3]), ["a", "b"])
    assert "rank 3 (ranks=1): 'b'" in repr(vm)
    assert vm.item(ranks=1) == "b"
