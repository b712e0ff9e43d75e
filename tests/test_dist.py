"""torch.distributed across local ranks: DDP training gives identical parameters."""

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
