"""DDP training that sets up and tears down its own process group, as under torchrun."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out-ddp_train")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    target = torch.linspace(-1, 1, 16)
    for step in range(args.steps):
        x = torch.randn(64, 16, generator=data)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), torch.sin(x @ target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 4:
            print(f"rank {rank}/{world} step {step + 1} loss {loss.item():.6f}")
    os.makedirs(args.out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()},
               os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
