#!/usr/bin/env bash
# Install the peers (benchmark-only dependencies) and run the core benchmark.
# usage: bash benchmarks/run.sh [--quick] [--only ours,raw,ipyparallel,monarch]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,bench"
# PyTorch Monarch is optional: the benchmark prints why it was skipped if it will not install.
.venv/bin/pip install -q --disable-pip-version-check torchmonarch || echo "torchmonarch did not install; Monarch will be skipped"
.venv/bin/python benchmarks/bench_core.py "$@"
