"""torch.distributed across local ranks: DDP training gives identical parameters."""

import os
import stat

import pytest

DDP_CELL = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + dist.get_rank())   # each rank sees different data
w_true = torch.arange(8.0) / 8
losses = []
for step in range(30):
    x = torch.randn(32, 8, generator=g)
    y = x @ w_true
    loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
(losses[0], losses[-1], flat)
"""


def test_ddp_training_gives_bit_identical_parameters(mesh4, sink):
    vm = mesh4.run(DDP_CELL, sink=sink, timeout=120)
    results = list(vm.values())
    reference = results[0][2]
    for first, last, flat in results:
        assert last < first  # the loss went down on every rank
        assert flat.dtype == reference.dtype and bool((flat == reference).all())  # bit-identical
    assert len({r[0] for r in results}) > 1  # ranks really saw different data


def test_collectives_and_ranks(mesh4, sink):
    vm = mesh4.run("import torch, torch.distributed as dist\nout = [None] * 4\n"
                   "dist.all_gather_object(out, dist.get_rank() ** 2)\n"
                   "(dist.get_backend(), dist.get_world_size(), out)", sink=sink)
    assert list(vm.values()) == [("gloo", 4, [0, 1, 4, 9])] * 4


@pytest.mark.parametrize("backend", ["none"])
def test_no_process_group(backend, sink):
    from monarch_kernel import local_mesh

    with local_mesh(gpus=2, dist=backend) as mesh:
        vm = mesh.run("import torch.distributed as dist\ndist.is_initialized()", sink=sink)
        assert list(vm.values()) == [False, False]


LIGHT_CELL = """
import os, sys
before = "torch" in sys.modules
import torch, torch.distributed as dist
try:
    dist.init_process_group()
    advice = None
except RuntimeError as exc:
    advice = str(exc)
(before, torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"]), advice)
"""


def test_without_a_process_group_ranks_start_light_and_set_torch_up_at_first_import(sink):
    from monarch_kernel import local_mesh

    with local_mesh(gpus=2, dist="none") as mesh:
        for before, threads_shared, advice in mesh.run(LIGHT_CELL, sink=sink).values():
            assert before is False  # nothing imported torch before the user did
            assert threads_shared  # the cores are shared among the host's ranks, as when torch is preloaded
            assert advice is not None and "without a process group" in advice  # the mesh's own advice


def test_preload_imports_modules_before_ranks_fork(sink):
    from monarch_kernel import MeshStartError, MeshUsageError, local_mesh

    with local_mesh(gpus=2, dist="none", preload=["torch", "email.mime.text"]) as mesh:
        loaded = mesh.run("import sys\n('torch' in sys.modules, 'email.mime.text' in sys.modules)", sink=sink)
        assert list(loaded.values()) == [(True, True)] * 2
    with pytest.raises(MeshStartError, match=r"(?s)cannot preload 'no_such_module_here'.*ModuleNotFoundError"):
        local_mesh(gpus=1, dist="none", preload=["no_such_module_here"])
    with pytest.raises(MeshUsageError, match="module names"):
        local_mesh(gpus=1, dist="none", preload=["torch; rm -rf"])


STORE_CELL = """
import os, socket, stat, torch.distributed as dist
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
with socket.socket() as probe:
    refused = probe.connect_ex((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))) != 0
(type(store).__name__, refused)
"""


def test_single_host_store_is_a_file_in_the_private_folder(mesh4, sink):
    """Other local users cannot reach the rendezvous (F4): no TCP store listens on MASTER_PORT."""
    vm = mesh4.run(STORE_CELL, sink=sink)
    assert list(vm.values()) == [("FileStore", True)] * 4
    shm_dir = mesh4._runtime.state.shm_dir
    assert shm_dir is not None and stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o700
    assert any(name.startswith("store-") for name in os.listdir(shm_dir))
