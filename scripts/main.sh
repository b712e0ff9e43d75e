#!/usr/bin/env bash
# The main job: install, then execute notebooks/01_quickstart.ipynb headless on a local
# 4-rank CPU mesh and save it with its outputs (notebooks/01_quickstart.executed.ipynb).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh notebooks
.venv/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb --show
