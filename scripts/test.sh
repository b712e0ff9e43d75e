#!/usr/bin/env bash
# Install everything the tests need and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The SSH tests run real sshd servers in network namespaces: they need root, openssh-server
# and iproute2 (they are skipped, with the reason, where those are missing).
# The browser test renders an executed notebook in Debian's chromium. The Slurm tests run a
# real cluster (Debian's slurmctld, slurmd and munge) in network namespaces.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && { [ ! -x /usr/sbin/sshd ] || ! command -v ip >/dev/null || [ ! -x /usr/bin/chromium ] \
        || [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ]; }; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client iproute2 chromium >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
# The tests need the JupyterLab sidebar built: fail here, not in a test, if npm is missing.
MONARCH_KERNEL_REQUIRE_LABEXTENSION=1 bash scripts/setup.sh test
# The widget renderer for notebooks exported to HTML (nbconvert loads it from a CDN by
# default; the browser test serves it from here, offline).
if [ ! -f .cache/widgets/node_modules/@jupyter-widgets/html-manager/dist/embed-amd.js ] && command -v npm >/dev/null; then
  mkdir -p .cache/widgets
  (cd .cache/widgets && npm install --silent --no-audit --no-fund @jupyter-widgets/html-manager@1 requirejs@2 >/dev/null)
fi
# Another cloudpickle than the one installed, for a host whose versions differ from the
# notebook's (tests/test_workspace.py: the mismatch is warned at up and by %mesh env).
if [ ! -d .cache/old-cloudpickle/cloudpickle ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .cache/old-cloudpickle "cloudpickle==3.0.0"
fi
# Lint (with import order) and types before the tests: both must pass.
# the real PyTorch Monarch, in an environment of its own, for the conformance suite (tests/test_conformance.py
# says why it skips when this fails)
if ! .cache/monarch-venv/bin/python -c "import monarch.actor" >/dev/null 2>&1; then
  rm -rf .cache/monarch-venv
  { .venv/bin/python -m venv .cache/monarch-venv \
    && .cache/monarch-venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 torchmonarch==0.7.0; } \
    || echo "torchmonarch 0.7.0 could not be installed: the conformance tests will skip" >&2
fi
.venv/bin/ruff check .
.venv/bin/mypy
# The documentation site, warnings (a broken internal link among them) as errors.
.venv/bin/sphinx-build -q -W --keep-going -b html docs docs/_build/html
.venv/bin/python -m pytest tests --durations=40 "$@"  # (the slowest tests, for keeping CI under 25 minutes)
