#!/usr/bin/env bash
# Create .venv (if missing) and install monarch-kernel into it, editable, with extras.
# usage: scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# torch first, pinned: this exact CPU build is what the project is tested with; a looser
# request would pull a multi-GB CUDA build. On a GPU host, install your CUDA torch instead.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
