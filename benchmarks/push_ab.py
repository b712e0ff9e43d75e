"""A push of 64 MiB to 4 local ranks against an in-process copy of 64 MiB, in one run.

    .venv/bin/python benchmarks/push_ab.py [--rounds 3]

Prints the medians and their ratio (the target: a push at most 2x the copy). To compare with the
code before a change, run it once on each checkout, or swap the changed function and run again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import timed  # noqa: E402

import monarch_kernel as mk  # noqa: E402


def median_seconds(fn) -> float:
    """Median seconds of fn over 15 calls, after 2 warm-up calls (benchmarks/common.timed)."""
    return statistics.median(timed(fn, 15, 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with mk.local_mesh(gpus=4, dist="none", name="push-ab") as mesh:
        values = torch.randn(16 << 20)  # 64 MiB
        block = np.ones(64 << 20, dtype=np.uint8)
        for _ in range(args.rounds):
            copy, push = median_seconds(block.copy), median_seconds(lambda: mesh.push(t=values))
            print(f"push 64 MiB to 4 local ranks {push * 1e3:.1f} ms | in-process copy {copy * 1e3:.1f} ms | "
                  f"ratio {push / copy:.2f}x")


if __name__ == "__main__":
    main()
