"""DTensor on a two-dimensional device mesh (dp x tp): shard, compute, redistribute, reduce."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out-dtensor_2d")
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    mesh = init_device_mesh("cpu", (2, int(os.environ["WORLD_SIZE"]) // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    a = torch.randn(args.size, args.size)
    b = torch.randn(args.size, args.size)
    da = distribute_tensor(a, mesh, [Shard(0), Replicate()])
    db = distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    product = da @ db
    summed = product.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    tp_rank = mesh.get_local_rank("tp")
    print(f"dp {mesh.get_local_rank('dp')} tp {tp_rank} placements {product.placements} "
          f"local {tuple(product.to_local().shape)} sum {float(summed.sum()):.4f}")
    os.makedirs(args.out, exist_ok=True)
    torch.save({"product": summed, "local": product.to_local().clone()},
               os.path.join(args.out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
