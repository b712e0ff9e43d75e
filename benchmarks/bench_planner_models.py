"""The planner on models nobody here wrote, in one run on a 4-rank CPU mesh (gloo): Hugging Face Llama,
GPT-2, BERT and Mixtral built from configs (nothing downloaded), a DLRM-style recommender, a ResNet-style
BatchNorm net and a torchtitan-style Llama (blocks in an nn.ModuleDict).

For each: every layout the plan offers is applied and trained for three steps against the same training in
one process (largest relative loss difference), the plan is trialled (estimated against measured peak
memory per rank and step time), and the place of the fastest measured layout in the plan's own order
(before the trial) is reported.

    .venv/bin/python benchmarks/bench_planner_models.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import cloudpickle  # noqa: E402
import planner_models as pm  # noqa: E402

import monarch_kernel  # noqa: E402
from monarch_kernel.planner.apply import TrainingSpec, reference_losses  # noqa: E402

cloudpickle.register_pickle_by_value(pm)
cloudpickle.register_pickle_by_value(pm.gpt_model)

SUITE = {  # name: (build, batch, loss, strategies, optimizer, lr)
    "llama (HF)": (pm.build_hf_llama, pm.hf_token_batch, pm.hf_lm_loss, ("ddp", "fsdp", "tp", "pp"), "adamw", 3e-3),
    "gpt2 (HF)": (pm.build_hf_gpt2, pm.hf_token_batch, pm.hf_lm_loss, ("ddp", "fsdp", "tp", "pp"), "adamw", 3e-3),
    "bert (HF)": (pm.build_hf_bert, pm.hf_batch, pm.hf_lm_loss, ("ddp", "fsdp", "tp"), "adamw", 3e-3),
    "mixtral (HF)": (pm.build_hf_mixtral, pm.hf_batch, pm.hf_lm_loss, ("ddp", "fsdp", "tp"), "adamw", 3e-3),
    "recommender": (pm.build_recommender, pm.recommender_batch, pm.click_loss, ("ddp", "fsdp", "tp"), "adamw", 3e-3),
    "resnet-style (BatchNorm)": (pm.build_batchnorm, pm.conv_batch, pm.class_loss, ("ddp", "fsdp"), "sgd", 0.1),
    "torchtitan-style": (pm.build_titan, pm.titan_batch, pm.lm_loss, ("ddp", "fsdp", "tp", "pp"), "adamw", 3e-3),
}


def one(mesh, name: str) -> tuple[bool, bool]:
    """Report one architecture; (every layout trained as one process and within 10%, fastest in the top two)."""
    build, batch, loss, strategies, optimizer, lr = SUITE[name]
    started = time.perf_counter()
    plan = mesh.plan(build, batch, loss=loss, optimizer=optimizer, lr=lr, memory="1GiB", strategies=strategies)
    planned = time.perf_counter() - started
    order = [c.layout for c in plan.candidates if c.fits]
    expected = reference_losses(TrainingSpec(build, loss, optimizer, lr, 0), [batch()] * 3)
    differences = {}
    for layout in order:
        plan.apply(layout, seed=0)
        mesh.push(_batch=batch)
        losses = mesh.run("[train_step(_batch()) for _ in range(3)]").by_rank()
        differences[layout] = max(abs(a - b) / abs(b) for got in losses.values() for a, b in zip(got, expected))
    plan.trial(steps=3)
    print(f"\n**{name}**: planned in {planned:.1f} s; {len(order)} layouts offered"
          + ("".join(f"; {c.layout} n/a ({c.reason[:90]})" for c in plan.candidates if not c.applicable)))
    print("| layout | loss vs one process | est. peak | measured peak | ratio | est. step | measured step |")
    print("|---|---|---|---|---|---|---|")
    within = True
    for candidate in plan.candidates:
        if candidate.layout not in differences:
            continue
        ratio = candidate.peak_bytes / (candidate.measured_peak_bytes or 1)
        within &= 0.9 <= ratio <= 1.1 and differences[candidate.layout] <= 1e-5
        print(f"| {candidate.layout} | {differences[candidate.layout]:.1e} | {candidate.peak_bytes / 2**20:.2f} MiB | "
              f"{(candidate.measured_peak_bytes or 0) / 2**20:.2f} MiB | {ratio:.3f} | "
              f"{candidate.step_seconds * 1e3:.1f} ms | {(candidate.measured_step_seconds or 0) * 1e3:.1f} ms |")
    fastest = min((c for c in plan.candidates if c.measured_step_seconds), key=lambda c: c.measured_step_seconds)
    place = order.index(fastest.layout) + 1
    print(f"fastest measured: {fastest.layout}, number {place} in the plan's order before the trial")
    return within, place <= 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    names = args.only or list(SUITE)
    results = {}
    with monarch_kernel.local_mesh(gpus=4, dist="gloo", name="bench-models") as mesh:
        for name in names:
            results[name] = one(mesh, name)
    good = sum(1 for within, _ in results.values() if within)
    top = sum(1 for _, in_top in results.values() if in_top)
    print(f"\n{good} of {len(results)} architectures: every offered layout trains as one process (1e-5) with its "
          f"estimated peak within 10%; fastest measured layout in the plan's top two for {top} of {len(results)}")


if __name__ == "__main__":
    main()
