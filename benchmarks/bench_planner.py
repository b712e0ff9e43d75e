"""The planner: how long a plan takes and how light it keeps the notebook, and how close its
estimates come to what a trial measures, in one run.

1. A 1.2B-parameter GPT planned for 8 ranks (world={"hosts": 1, "gpus": 8}, device="H100"):
   seconds until the plan is ready, and how much the notebook's resident memory grew (the
   estimates run on fake tensors in helper processes).
2. On a 4-rank CPU mesh (gloo), every fitting layout of a small GPT: estimated against measured
   peak memory per rank and step time, and where the plan ranked the fastest measured one.

    .venv/bin/python benchmarks/bench_planner.py [--skip-large]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import cloudpickle  # noqa: E402
import planner_models as pm  # noqa: E402

import monarch_kernel  # noqa: E402

cloudpickle.register_pickle_by_value(pm)
cloudpickle.register_pickle_by_value(pm.gpt_model)


def big_gpt():
    # 1.2B parameters: 24 blocks of d=2048 (12 d^2 each) plus a 32k vocabulary
    return pm.GPT(vocab=32000, d=2048, heads=16, layers=24, ctx=16)


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def large() -> None:
    before, peak_before = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    plan = monarch_kernel.plan(big_gpt, pm.batch, loss=pm.lm_loss, world={"hosts": 1, "gpus": 8}, device="H100")
    seconds = time.perf_counter() - started
    grown = max(rss() - before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before)
    params = next(c for c in plan.candidates if c.layout == "ddp=8").memory["params"] / 4
    print(f"1.2B GPT ({params / 1e9:.2f}B parameters) planned for 8 H100 ranks: {seconds:.1f} s, "
          f"notebook memory grew {grown / 2**20:.0f} MiB")
    print(plan)


def small() -> None:
    with monarch_kernel.local_mesh(gpus=4, dist="gloo", name="bench-planner") as mesh:
        plan = mesh.plan(pm.build_wide, pm.batch, loss=pm.lm_loss, memory="10MiB")
        order = [c.layout for c in plan.candidates if c.fits]
        plan.trial(steps=5)
        print("\nlayout | est. peak/rank | measured peak | ratio | est. step | measured step")
        print("--- | --- | --- | --- | --- | ---")
        for c in plan.candidates:
            if not c.fits:
                print(f"{c.layout} | {c.peak_bytes / 2**20:.2f} MiB | (does not fit: {c.reason}) | | |")
                continue
            print(f"{c.layout} | {c.peak_bytes / 2**20:.2f} MiB | {c.measured_peak_bytes / 2**20:.2f} MiB | "
                  f"{c.peak_bytes / c.measured_peak_bytes:.3f} | {c.step_seconds * 1e3:.1f} ms | "
                  f"{c.measured_step_seconds * 1e3:.1f} ms")
        fastest = min((c for c in plan.candidates if c.fits), key=lambda c: c.measured_step_seconds)
        print(f"\nfastest measured: {fastest.layout}, ranked {order.index(fastest.layout) + 1} of {len(order)} "
              f"by the estimate (plan order: {', '.join(order)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    if not args.skip_large:
        large()
    small()


if __name__ == "__main__":
    main()
