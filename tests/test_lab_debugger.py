"""JupyterLab's own debugger on a rank, in a real JupyterLab driven in Debian's chromium: the user
picks the rank in the Meshes sidebar, turns the debugger on in the notebook's toolbar, clicks the
gutter of a `%%mesh` cell, runs it, and reads the rank's values in the Variables panel; the call
stack names the cell. A screenshot of the
panels is kept (artifacts/debugger_on_a_rank.png)."""

from __future__ import annotations

import pytest
from chromium import artifact, browser, missing
from labserver import cells, lab_server, open_lab, run_cell, wait_for_text, write_notebook

SETUP = "%load_ext monarch_kernel\n%mesh up local --gpus 2 --dist none --name dbg"
PANEL = "#monarch-kernel-meshes"
MESH = f'{PANEL} .mk-mesh[data-mesh="dbg"]'
CELL = """%%mesh
import os, torch
x = 10 * int(os.environ["RANK"]) + 7
t = torch.full((2, 3), float(x))
y = x + 1
print("rank", os.environ["RANK"], "y", y)"""
STOP_LINE = 5  # y = x + 1 (the cell's fifth line)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing("jupyterlab") is not None, reason=str(missing("jupyterlab")))]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root, home = tmp_path_factory.mktemp("lab"), tmp_path_factory.mktemp("lab-home")
    write_notebook(root / "debug.ipynb", SETUP, CELL)
    with lab_server(root, home) as (base, token), browser() as chromium:
        tab = chromium.new_page(viewport={"width": 1600, "height": 1000})
        tab.set_default_timeout(30_000)
        open_lab(tab, base, token, "debug.ipynb")
        yield tab


def _variables(tab) -> dict[str, str]:
    """The Variables panel's rows, name to value (as shown)."""
    return tab.evaluate("""() => {
        const out = {};
        for (const row of document.querySelectorAll('.jp-DebuggerVariables-body jp-tree-item')) {
            const name = row.querySelector(':scope > .jp-DebuggerVariables-name');
            const value = row.querySelector(':scope > .jp-DebuggerVariables-detail');
            if (name && value) out[name.textContent.replace(/:$/, '').trim()] = value.textContent.trim();
        }
        return out; }""")


def test_a_gutter_breakpoint_stops_the_rank_and_the_variables_panel_shows_its_values(page):
    run_cell(page, 0)
    wait_for_text(page, 0, "mesh 'dbg'", 120)
    page.click('.jp-SideBar .lm-TabBar-tab[data-id="monarch-kernel-meshes"]')
    page.locator(f'{MESH} .mk-rank[data-rank="1"]').click(timeout=60_000)  # its recent output, and a choice
    page.locator(f'{MESH} button[data-action="debug"][data-rank="1"]').click()
    page.wait_for_selector(f'{MESH} .mk-rank[data-rank="1"] .mk-rank-debugged', timeout=30_000)
    assert page.locator(f"{MESH} .mk-rank-debugged").count() == 1  # the one rank the debugger stops in
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-DebuggerBugButton").click()
    page.wait_for_selector(".jp-DebuggerBugButton.lm-mod-toggled, .jp-DebuggerBugButton [aria-pressed=true]",
                           timeout=30_000)
    cell = cells(page).nth(1)
    cell.click()
    gutter = cell.locator("div.cm-gutter.cm-breakpoint-gutter")
    gutter.wait_for(state="visible")
    line = cell.locator(".cm-line").nth(STOP_LINE - 1).bounding_box()
    box = gutter.bounding_box()
    assert line is not None and box is not None
    page.mouse.click(box["x"] + box["width"] / 2, line["y"] + line["height"] / 2)
    page.wait_for_selector(".jp-DebuggerBreakpoint", timeout=30_000)  # the Breakpoints panel lists it
    run_cell(page, 1)
    page.wait_for_function("""() => { const names = [...document.querySelectorAll('.jp-DebuggerVariables-name')];
        return names.some(n => n.textContent.trim().replace(/:$/, '') === 'x'); }""", timeout=120_000)
    shown = _variables(page)
    assert shown.get("x") == "17", shown  # rank 1's value, not the notebook's
    assert shown.get("t") == "Tensor", shown  # (the tree shows a nested value's type; its value: DAP test)
    frames = page.locator(".jp-DebuggerCallstackFrame").all_inner_texts()
    assert frames and frames[0].split() == ["<module>", "Cell", "[*]:5"], frames  # JupyterLab knows the cell
    page.screenshot(path=artifact("debugger_on_a_rank.png"))
    page.locator("jp-button.jp-ToolbarButtonComponent[title^='Continue']").click()  # the Callstack panel's button
    shown_output = wait_for_text(page, 1, "rank 1 y 18", 60)
    assert "rank 0 y 8" in shown_output, shown_output
