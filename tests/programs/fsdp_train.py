"""FSDP2 (fully_shard) training with a distributed checkpoint save, as under torchrun."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out-fsdp_train")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7 + dist.get_rank())
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=data)
        y = torch.randint(0, 4, (16,), generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {dist.get_rank()} step {step + 1} loss {loss.item():.6f}")
    os.makedirs(args.out, exist_ok=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(args.out, "checkpoint"))
    shards = {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}
    torch.save(shards, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
