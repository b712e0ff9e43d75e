"""The Meshes sidebar in a real JupyterLab, driven in Debian's chromium.

A JupyterLab server runs on loopback with a token (its config, data and workspaces in a
temporary folder); the page is driven by playwright as a user would: the panel is opened
from the left sidebar and its buttons are clicked. The tests run in file order and share
one server, one browser page and one notebook kernel.
"""

import subprocess
import sys
import time

import pytest
from chromium import artifact, browser, contrast_report, missing
from labserver import cells, lab_server, open_lab, open_notebook, run_cell, wait_for_text, wait_kernel_idle, write_notebook

PANEL = "#monarch-kernel-meshes"
MESH = f'{PANEL} .mk-mesh[data-mesh="lab"]'
SLEEP_CELL = "%%mesh\nimport time\nprint('napping on rank', __import__('os').environ['RANK'])\ntime.sleep(60)"
# a 32-host x 4-GPU mesh as the kernel would describe it (every state, loads, GPUs), sent through
# the real comm: the panel cannot tell it from a live one (only this machine cannot start one)
BIG_CELL = """%load_ext monarch_kernel
from monarch_kernel.magics import sidebar
STATES = ["idle", "busy", "dead", "unresponsive", "starting"]
HOSTS = [f"node{h:02d}" for h in range(32)]
def synthetic(registry, *_):
    ranks = [{"rank": r, "coords": {"hosts": r // 4, "gpus": r % 4}, "host": HOSTS[r // 4], "local_rank": r % 4,
              "pid": 1000 + r, "state": STATES[r % 5], "detail": "cell 3 for 1.2 s" if r % 5 == 1 else "",
              "cpu": float(r % 90), "rss": (200 + r) << 20, "mem_total": 64 << 30,
              "gpu_used": (r % 79 + 1) << 30, "gpu_total": 80 << 30, "gpu_util": float(r % 100)} for r in range(128)]
    return [{"name": "big", "kind": "slurm", "shape": {"hosts": 32, "gpus": 4}, "hosts": HOSTS, "dist": "nccl",
             "state": "up", "default": True, "ranks": ranks,
             "allocation": "Slurm job 7: RUNNING on node[00-31], 1:58:00 left"}]
sidebar.describe_meshes = synthetic
"""
BIG = f'{PANEL} .mk-mesh[data-mesh="big"]'


def _why_not() -> str | None:
    why = missing("jupyterlab")
    if why:
        return why
    found = subprocess.run([sys.executable, "-m", "jupyterlab.labextensions", "list"],
                           capture_output=True, text=True).stderr
    if "monarch-kernel-meshes" not in found:
        return "the JupyterLab extension is not built and linked (scripts/setup.sh does both, with npm)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a token; yields its base URL and token."""
    root = tmp_path_factory.mktemp("lab")
    home = tmp_path_factory.mktemp("lab-home")
    write_notebook(root / "mesh.ipynb", "%load_ext monarch_kernel\n%mesh up local --gpus 2 --dist none --name lab",
                   SLEEP_CELL)
    write_notebook(root / "plain.ipynb", "1 + 1")
    write_notebook(root / "big.ipynb", BIG_CELL)
    with lab_server(root, home) as running:
        yield running


@pytest.fixture(scope="module")
def page(server):
    base, token = server
    with browser() as chromium:
        tab = chromium.new_page(viewport={"width": 1400, "height": 900})
        tab.set_default_timeout(30_000)
        open_lab(tab, base, token, "plain.ipynb")
        tab.click('.jp-SideBar .lm-TabBar-tab[data-id="monarch-kernel-meshes"]')
        tab.wait_for_selector(PANEL, state="visible")
        yield tab
        tab.screenshot(path=artifact("meshes_sidebar_last.png"))


def _use_theme(page, theme: str) -> None:
    """Switch JupyterLab's theme and wait until its stylesheet applies (it is swapped in after the attribute)."""
    page.evaluate("name => window.jupyterapp.commands.execute('apputils:change-theme', {theme: name})", theme)
    page.wait_for_function("name => document.body.dataset.jpThemeName === name", arg=theme, timeout=30_000)
    page.wait_for_function("""([selector, dark]) => {
        const m = getComputedStyle(document.querySelector(selector)).backgroundColor.match(/\\d+/g);
        const level = m ? (+m[0] + +m[1] + +m[2]) / 3 : 128;
        return dark ? level < 100 : level > 155; }""", arg=[PANEL, theme.endswith('Dark')], timeout=30_000)


def test_the_extension_is_installed_and_enabled():
    listed = subprocess.run([sys.executable, "-m", "jupyterlab.labextensions", "list"],
                            capture_output=True, text=True).stderr
    line = next(line for line in listed.splitlines() if "monarch-kernel-meshes" in line)
    assert "enabled" in line and "OK" in line


def test_without_monarch_kernel_the_panel_says_how_to_load_it(page):
    page.wait_for_selector(f'{PANEL} .mk-body[data-state="not-loaded"]')
    assert "%load_ext monarch_kernel" in page.locator(f"{PANEL} .mk-body").inner_text()


def test_the_panel_lists_the_mesh_and_its_ranks(page):
    open_notebook(page, "mesh.ipynb")
    assert page.locator(f"{PANEL} .mk-context").inner_text() == "mesh.ipynb"
    run_cell(page, 0)  # %load_ext + %mesh up: the extension announces itself, the panel links up
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"]', timeout=60_000)
    ranks = page.locator(f"{MESH} .mk-rank")
    assert ranks.count() == 2
    assert "local" in page.locator(f"{MESH} .mk-meta").inner_text()
    assert "hosts 1 × gpus 2" in page.locator(f"{MESH} .mk-meta").inner_text()
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="0"][data-state="idle"]')
    assert page.locator(f"{MESH} .mk-badge").inner_text() == "default"


def test_a_rank_turns_busy_and_interrupt_ends_the_cell(page):
    wait_kernel_idle(page)
    run_cell(page, 1)  # sleeps 60 s on both ranks
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="0"][data-state="busy"]', timeout=15_000)
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"][data-state="busy"]', timeout=15_000)
    wait_for_text(page, 1, "napping on rank 1", 15)
    page.locator(PANEL).screenshot(path=artifact("meshes_sidebar_busy.png"))
    # live updates while busy ("for N s" moves) replace only what changed: the buttons stay
    # the same elements, so a click is never lost to a re-render
    button = page.query_selector(f'{MESH} button[data-action="interrupt"]')
    detail = page.inner_text(f'{MESH} .mk-rank[data-rank="0"] .mk-rank-detail')
    page.wait_for_function("([sel, old]) => { const el = document.querySelector(sel);"
                           " return el && el.innerText !== old; }",
                           arg=[f'{MESH} .mk-rank[data-rank="0"] .mk-rank-detail', detail], timeout=5_000)
    assert button.evaluate("el => el.isConnected")
    started = time.monotonic()
    page.click(f'{MESH} button[data-action="interrupt"]')
    # the cell ends with the ranks' KeyboardInterrupt, well before its 60 s sleep would
    assert "time.sleep(60)" in wait_for_text(page, 1, "KeyboardInterrupt", 15)
    assert time.monotonic() - started < 15
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="0"][data-state="idle"]', timeout=10_000)
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"][data-state="idle"]', timeout=10_000)


def test_a_ranks_logs_and_inserting_a_mesh_cell(page):
    page.click(f'{MESH} .mk-rank[data-rank="1"]')
    page.wait_for_selector(f'{MESH} .mk-logs[data-rank="1"]')
    assert "napping on rank 1" in page.locator(f"{MESH} .mk-logs pre").inner_text()
    cells_before = cells(page).count()
    page.click(f'{MESH} button[data-action="insert"]')
    t0 = time.monotonic()
    while cells(page).count() != cells_before + 1:
        assert time.monotonic() - t0 < 10, "no cell was inserted"
        time.sleep(0.1)
    source = page.evaluate("window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.getSource()")
    assert source.startswith("%%mesh --name lab")
    page.locator(PANEL).screenshot(path=artifact("meshes_sidebar.png"))


@pytest.mark.parametrize("theme", ["JupyterLab Dark", "JupyterLab Light"])  # (light last: the tests after expect it)
def test_the_panel_reads_in_the_light_and_the_dark_theme(page, theme):
    _use_theme(page, theme)
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"] .mk-rank-state')
    measured = contrast_report(page, f"{PANEL} *")
    page.locator(PANEL).screenshot(path=artifact(f"meshes_sidebar_{theme.split()[-1].lower()}.png"))
    assert len(measured) > 10
    poor = [m for m in measured if m["ratio"] < 4.5]
    assert not poor, poor[:10]
    states = page.locator(f"{MESH} .mk-rank-state").all_inner_texts()
    assert states and all(text.split()[-1] in ("idle", "busy", "dead", "unresponsive", "starting") and
                          not text.split()[0].isalpha() for text in states)  # a glyph, then the word


@pytest.mark.parametrize("theme", ["JupyterLab Dark", "JupyterLab Light"])
def test_a_128_rank_mesh_folds_its_32_hosts_into_summary_lines(page, theme):
    open_notebook(page, "big.ipynb")
    run_cell(page, 0)
    _use_theme(page, theme)
    page.wait_for_selector(f"{BIG} .mk-host", timeout=30_000)
    hosts = page.locator(f"{BIG} .mk-host")
    assert hosts.count() == 32
    assert page.locator(f"{BIG} .mk-rank").count() == 0  # past 8 hosts each starts folded into its line
    assert "128 ranks: 26 idle" in page.locator(f"{BIG} .mk-counts").inner_text()
    first = page.locator(f'{BIG} .mk-host[data-host="node00"]')
    assert first.locator(".mk-host-summary").inner_text().startswith("1 idle")  # ranks 0-3: idle, busy, dead, unresponsive
    first.locator('button[data-action="toggle-host"]').click()
    page.wait_for_selector(f'{BIG} .mk-host[data-host="node00"] .mk-rank[data-rank="3"]')
    tile = first.locator('.mk-rank[data-rank="1"]').inner_text()
    assert "GPU 1" in tile and "busy" in tile and "cell 3 for 1.2 s" in tile and "gpu" in tile
    assert first.locator(".mk-bar").count() == 16  # cpu, memory, GPU memory and utilization on each of the 4 tiles
    measured = contrast_report(page, f"{BIG} *")
    page.locator(PANEL).screenshot(path=artifact(f"meshes_sidebar_128_{theme.split()[-1].lower()}.png"))
    assert len(measured) > 40
    poor = [m for m in measured if m["ratio"] < 4.5]
    assert not poor, poor[:10]
    first.locator('button[data-action="toggle-host"]').click()  # folded again
    page.wait_for_selector(f'{BIG} .mk-host[data-host="node00"] .mk-rank', state="detached")


def test_switching_notebooks_switches_the_panel(page):
    open_notebook(page, "plain.ipynb")
    page.wait_for_selector(f'{PANEL} .mk-body[data-state="not-loaded"]')
    assert page.locator(f"{PANEL} .mk-context").inner_text() == "plain.ipynb"
    open_notebook(page, "mesh.ipynb")
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"]')


def test_down_asks_first_and_a_kernel_restart_clears_the_panel(page):
    page.click(f'{MESH} button[data-action="down"]')
    page.wait_for_selector(".jp-Dialog")
    page.click('.jp-Dialog button:has-text("Bring down")')
    page.wait_for_selector(MESH, state="detached", timeout=20_000)
    assert "No mesh in this kernel yet" in page.locator(f"{PANEL} .mk-body").inner_text()
    run_cell(page, 0)  # a mesh again, then restart the kernel under it
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"]', timeout=60_000)
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()")
    page.wait_for_selector(f'{PANEL} .mk-body[data-state="not-loaded"]', timeout=60_000)
    assert page.locator(f"{PANEL} .mk-mesh").count() == 0
