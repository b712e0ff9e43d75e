"""torchrun programs: launch-to-exit under torchrun against `%mesh run` on a warm mesh, in one run.

The programs are the test suite's (tests/programs/: DDP, FSDP2 with a checkpoint, tensor
parallel, 2-D DTensor, HuggingFace Trainer), 4 processes each. torchrun starts 4 fresh
interpreters every time (import torch, rendezvous, run, exit); the mesh starts once and
each `run_script` only runs the program. Times are medians of --repeat runs.

    .venv/bin/python benchmarks/bench_torchrun.py [--repeat 3] [--programs ddp_train,tp_train]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(HERE, "..", "tests", "programs")
sys.path.insert(0, HERE)
from common import NullSink  # noqa: E402

NAMES = ["ddp_train", "fsdp_train", "tp_train", "dtensor_2d", "hf_trainer"]
THREADS = {"OMP_NUM_THREADS": "1"}


def torchrun_seconds(name: str, out: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           os.path.join(PROGRAMS, f"{name}.py"), "--out", out], capture_output=True, text=True,
                          env={**os.environ, **THREADS})
    if done.returncode != 0:
        raise RuntimeError(f"torchrun {name} failed (status {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--programs", default=",".join(NAMES))
    args = parser.parse_args()
    from monarch_kernel import local_mesh

    names = [n for n in args.programs.split(",") if n]
    work = tempfile.mkdtemp(prefix="bench-torchrun-")
    start = time.perf_counter()
    mesh = local_mesh(gpus=4, dist="gloo", name="bench-torchrun", env=THREADS)
    startup = time.perf_counter() - start
    rows = []
    try:
        for name in names:
            runs, first = [], None
            for i in range(args.repeat + 1):
                t = time.perf_counter()
                mesh.run_script(os.path.join(PROGRAMS, f"{name}.py"), ["--out", os.path.join(work, f"{name}-m{i}")],
                                sink=NullSink(), timeout=600)
                took = time.perf_counter() - t
                if i == 0:
                    first = took  # the first run also imports what the program needs
                else:
                    runs.append(took)
            launched = [torchrun_seconds(name, os.path.join(work, f"{name}-t{i}")) for i in range(args.repeat)]
            rows.append((name, statistics.median(launched), first, statistics.median(runs)))
    finally:
        mesh.shutdown()
    print(f"4 processes per program, {os.cpu_count()} CPU cores, medians of {args.repeat} runs; "
          f"the mesh started once in {startup:.2f} s")
    print("| program | torchrun launch-to-exit | %mesh run, first | %mesh run, again | torchrun / again |")
    print("|---|---|---|---|---|")
    for name, launched, first, again in rows:
        print(f"| {name} | {launched:.2f} s | {first:.2f} s | {again:.2f} s | {launched / again:.0f}x |")


if __name__ == "__main__":
    main()
