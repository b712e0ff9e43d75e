"""Debian's chromium under playwright, headless, as the browser tests run it."""

import os
from contextlib import contextmanager

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts")
# no sandbox (CI runs as root); nothing fetched from the network behind the test's back
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]


def missing(*modules: str) -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not os.path.exists(CHROMIUM):
        return "Debian's chromium is not installed (scripts/test.sh installs it as root)"
    for name in ("playwright", *modules):
        try:
            __import__(name)
        except ImportError:
            return f"{name} is not installed (pip install -e .[test])"
    return None


@contextmanager
def browser():
    """A launched chromium (playwright Browser), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield launched
        finally:
            launched.close()


def artifact(name: str) -> str:
    """A path under artifacts/ for a screenshot kept after the run."""
    os.makedirs(ARTIFACTS, exist_ok=True)
    return os.path.join(ARTIFACTS, name)
