#!/usr/bin/env bash
# Install everything the tests need and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The SSH tests run real sshd servers in network namespaces: they need root, openssh-server
# and iproute2 (they are skipped, with the reason, where those are missing).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && { [ ! -x /usr/sbin/sshd ] || ! command -v ip >/dev/null; }; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client iproute2 >/dev/null
fi
bash scripts/setup.sh test
.venv/bin/python -m pytest tests "$@"
