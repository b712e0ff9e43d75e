"""Same-run A/B of our rows of a benchmark (bench_core, or bench_actors with --bench actors) against an
earlier commit: did a change move them?

The earlier commit is checked out (a git worktree under .cache/) and each round runs
bench_core's own measurement of monarch-kernel (`--child ours`) once with that commit's
package first on the path and once with this checkout's, in turn (which goes first alternates:
the second of a round tends to be slower), so both see the same machine at the same time.
Prints each row's medians over the rounds, their ratio, and the range of the rounds' own
ratios (the machine's spread; an A/A run, the same commit as `ref`, shows it alone).

    .venv/bin/python benchmarks/ab_commits.py 2ac1446 [--rounds 3] [--full] [--bench core|actors]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worktree(ref: str) -> str:
    """A checkout of `ref` under .cache/ (made once)."""
    path = os.path.join(ROOT, ".cache", f"ab-{ref}")
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, ref], check=True,
                       stdout=subprocess.DEVNULL)
    magics = os.path.join(path, "monarch_kernel", "magics")
    if not os.path.lexists(magics):  # the package maps the top-level magics/ into itself (pyproject.toml)
        os.symlink(os.path.join("..", "magics"), magics)
    return path


def measure(package_root: str, quick: bool, bench: str = "core") -> dict[str, list[float]]:
    """The benchmark's raw figures of our system, with the package from `package_root`."""
    env = dict(os.environ, PYTHONPATH=package_root)
    args = [sys.executable, os.path.join(HERE, f"bench_{bench}.py"), "--child", "ours"] + (["--quick"] if quick else [])
    with tempfile.TemporaryDirectory(prefix="ab-cwd-") as cwd:  # (the same empty project folder for both: a
        done = subprocess.run(args, env=env, cwd=cwd, capture_output=True,  # checkout's own files must not weigh)
                              text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench_{bench} failed with {package_root}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ref", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="the benchmark's full repetitions (default: --quick)")
    parser.add_argument("--bench", default="core", choices=("core", "actors"), help="which benchmark's rows")
    args = parser.parse_args()
    trees = {args.ref: worktree(args.ref), "this checkout": ROOT}
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for round_ in range(args.rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(trees.items())[::-1]  # (the second run of a
        for name, tree in order:                                                       # round is often slower)
            print(f"round {round_ + 1}: {name} ...", file=sys.stderr, flush=True)
            for row, values in measure(tree, not args.full, args.bench).items():
                values = values if isinstance(values, list) else [values]
                rows[name].setdefault(row, []).append(statistics.median(values))
    old, new = rows[args.ref], rows["this checkout"]
    print(f"| bench_{args.bench} row (median over {args.rounds} rounds, each taking both in turn, first one "
          f"then the other) | {args.ref} | this checkout | ratio | rounds' ratios (spread) |")
    print("|---|---|---|---|---|")
    for row in old:
        if row in new:
            a, b = statistics.median(old[row]), statistics.median(new[row])
            each = sorted(y / x for x, y in zip(old[row], new[row]))
            print(f"| {row} | {a:.6g} | {b:.6g} | {b / a:.2f} | {each[0]:.2f} to {each[-1]:.2f} |")


if __name__ == "__main__":
    main()
