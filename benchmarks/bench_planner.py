"""The planner: how long a plan takes and how light it keeps the notebook, and how close its
estimates come to what a trial measures, in one run.

1. A 1.2B-parameter GPT planned for 8 ranks (world={"hosts": 1, "gpus": 8}, device="H100"):
   seconds until the plan is ready, and how much the notebook's resident memory grew (the
   estimates run on fake tensors in helper processes).
2. On a 4-rank CPU mesh (gloo), every fitting layout of a small GPT: estimated against measured
   peak memory per rank and step time, and where the plan ranked the fastest measured one.
3. A Llama-2-7B (Hugging Face's LlamaForCausalLM from its config, nothing downloaded) planned for
   1 x 8 and 4 x 8 H100 in bf16 mixed precision with activation checkpointing as a choice: seconds,
   notebook growth, each layout's per-rank FLOPs against the hand formula (6 x parameters x tokens
   plus attention's 12 x layers x hidden x sequence x tokens, recompute added for ac=1), and whether the
   known-good recipe (FSDP over 8, bf16, checkpointing) fits.

    .venv/bin/python benchmarks/bench_planner.py [--skip-large] [--skip-small] [--skip-llama]
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


LLAMA = {"hidden": 4096, "layers": 32, "heads": 32, "mlp": 11008, "vocab": 32000, "seq": 2048}


def build_llama7b():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=LLAMA["hidden"], intermediate_size=LLAMA["mlp"],
                                        num_hidden_layers=LLAMA["layers"], num_attention_heads=LLAMA["heads"],
                                        num_key_value_heads=LLAMA["heads"], vocab_size=LLAMA["vocab"],
                                        max_position_embeddings=LLAMA["seq"]))


def llama_batch(samples: int):
    import torch

    def batch():
        ids = torch.randint(0, LLAMA["vocab"], (samples, LLAMA["seq"]), generator=torch.Generator().manual_seed(0))
        return ids, ids
    return batch


def llama_loss(output, targets):
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten())


def llama(hosts: int, samples: int) -> None:
    from monarch_kernel.planner.layout import Layout

    batch = llama_batch(samples)
    before, peak_before = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    plan = monarch_kernel.plan(build_llama7b, batch, loss=llama_loss, world={"hosts": hosts, "gpus": 8},
                               device="H100", memory="80GiB", precision="bf16", strategies=("ddp", "fsdp", "tp", "ac"))
    seconds = time.perf_counter() - started
    grown = max(rss() - before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before)
    params = 6_738_415_616
    print(f"\nLlama-2-7B, {hosts} x 8 H100, batch {samples} x {LLAMA['seq']}, bf16 mixed precision: planned in "
          f"{seconds:.1f} s, notebook memory grew {grown / 2**20:.0f} MiB")
    print("| layout | fits | peak/rank | per-rank TFLOP | by hand | ratio |")
    print("|---|---|---|---|---|---|")
    for candidate in plan.candidates:
        if not candidate.applicable:
            print(f"| {candidate.layout} | n/a | | | | {candidate.reason} |")
            continue
        layout = Layout.parse(candidate.layout)
        tokens = samples * LLAMA["seq"] / layout.data_parallel
        attention = 12 * LLAMA["layers"] * LLAMA["hidden"] * LLAMA["seq"] * tokens
        by_hand = (6 * params * tokens + attention) / layout.tp
        if layout.ac:  # the blocks' forward again: a third of their forward and backward
            by_hand += (2 * (params - 2 * LLAMA["vocab"] * LLAMA["hidden"]) * tokens + attention / 3) / layout.tp
        print(f"| {candidate.layout} | {'yes' if candidate.fits else 'no'} | {candidate.peak_bytes / 2**30:.1f} GiB "
              f"| {candidate.flops / 1e12:.1f} | {by_hand / 1e12:.1f} | {candidate.flops / by_hand:.3f} |")
    recipe = plan.candidate("fsdp=8,ac=1,mp=bf16" if hosts == 1 else "fsdp=32,ac=1,mp=bf16")
    print(f"known-good recipe {recipe.layout}: {'fits' if recipe.fits else 'does not fit'} "
          f"({recipe.peak_bytes / 2**30:.1f} GiB per rank); best: {plan.best.layout if plan.best else 'none'}")


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
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    if not args.skip_large:
        large()
    if not args.skip_small:
        small()
    if not args.skip_llama:
        llama(1, 8)
        llama(4, 32)


if __name__ == "__main__":
    main()
