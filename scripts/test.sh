#!/usr/bin/env bash
# Install everything the tests need and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m pytest tests "$@"
