"""A real JupyterLab for browser tests: the server on loopback with a token (its config, data and
workspaces in temporary folders), and what a test does in its page (open a notebook, run a cell, read
a cell's output), through JupyterLab's own commands where a user would click."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbformat


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: Path, *sources: str) -> None:
    """A notebook of code cells for the python3 kernel."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


@contextmanager
def lab_server(root: Path, home: Path) -> Iterator[tuple[str, str]]:
    """JupyterLab serving `root` (its own settings under `home`); yields (base URL, token). Stopping it
    shuts its kernels down, and they their meshes."""
    token, port = secrets.token_hex(16), free_port()
    notification = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True, exist_ok=True)
    notification.write_text(json.dumps({"fetchNews": "false"}))  # (no "notified about Jupyter news?" over the panels)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", "--LabApp.expose_app_in_browser=True",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=None"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    json.load(r)
                break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (home / "server.log").read_text()[-3000:]) from exc
                time.sleep(0.3)
        yield base, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def open_lab(tab, base: str, token: str, path: str) -> None:
    """Load JupyterLab in `tab` with notebook `path` open and its kernel idle."""
    tab.goto(f"{base}/lab/tree/{path}?token={token}")
    tab.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget"
                          " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
    wait_kernel_idle(tab)


def wait_kernel_idle(tab, timeout_ms: int = 60_000) -> None:
    """Until the kernel of the notebook in focus is idle."""
    tab.wait_for_function("(() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel;"
                          " return k && k.status === 'idle'; })()", timeout=timeout_ms)


def open_notebook(tab, name: str) -> None:
    """Open notebook `name` (or bring it to focus) and wait for its kernel."""
    tab.evaluate("name => window.jupyterapp.commands.execute('docmanager:open', {path: name})", name)
    tab.wait_for_function("name => window.jupyterapp.shell.currentWidget?.context?.path === name", arg=name)
    wait_kernel_idle(tab)


def run_cell(tab, index: int) -> None:
    """Select cell `index` of the current notebook and run it (returns once it is sent)."""
    tab.evaluate("""i => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        nb.activeCellIndex = i;
        void window.jupyterapp.commands.execute('notebook:run-cell');  // resolves when the cell ends
    }""", index)


def cells(tab):
    """The cells of the notebook in focus (other notebooks' tabs stay in the page, hidden)."""
    current = tab.evaluate("window.jupyterapp.shell.currentWidget.id")
    return tab.locator(f"#{current} .jp-Notebook .jp-Cell")


def cell_text(tab, index: int) -> str:
    """What cell `index` of the notebook in focus shows as output."""
    return cells(tab).nth(index).locator(".jp-Cell-outputArea").inner_text()


def wait_for_text(tab, index: int, text: str, timeout: float) -> str:
    """Wait until cell `index`'s output shows `text`; returns the output."""
    deadline = time.monotonic() + timeout
    while text not in (shown := cell_text(tab, index)):
        assert time.monotonic() < deadline, f"{text!r} not shown within {timeout} s; cell shows:\n{shown}"
        time.sleep(0.1)
    return shown
