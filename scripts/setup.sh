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
# Installing also builds the JupyterLab Meshes sidebar (labextension/, with npm) when its
# sources changed; an editable install then links the build where JupyterLab looks for it.
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
if [ -x .venv/bin/jupyter-builder ] && [ -f monarch_kernel/labextension/package.json ]; then
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/jupyter-builder develop --overwrite . >/dev/null
fi
