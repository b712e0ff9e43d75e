"""Tensor parallelism with parallelize_module: a column- then row-parallel MLP, trained a few steps."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(24, 64)
        self.down = torch.nn.Linear(64, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out-tp_train")
    args = parser.parse_args()
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))  # sets up the process group itself
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(3)  # tensor parallel: every rank sees the same batch
    for step in range(6):
        x = torch.randn(8, 24, generator=data)
        loss = (model(x) - x.flip(-1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {loss.item():.6f}")
    os.makedirs(args.out, exist_ok=True)
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    torch.save(full, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
