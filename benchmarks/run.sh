#!/usr/bin/env bash
# Install the peers (benchmark-only dependencies) and run the core and actor benchmarks.
# usage: bash benchmarks/run.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,bench"
# PyTorch Monarch and Ray are optional: a benchmark prints why a peer was skipped if it will not install.
.venv/bin/pip install -q --disable-pip-version-check torchmonarch || echo "torchmonarch did not install; Monarch will be skipped"
.venv/bin/pip install -q --disable-pip-version-check "ray>=2.40" || echo "ray did not install; Ray will be skipped"
.venv/bin/python benchmarks/bench_core.py "$@"
echo
.venv/bin/python benchmarks/bench_actors.py "$@"
