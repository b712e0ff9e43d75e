"""The visualization notebook, executed, exported with its widget state, rendered in Chromium.

Debian's chromium runs headless (no sandbox, no background networking) under playwright;
the widget renderer (@jupyter-widgets/html-manager, installed by scripts/test.sh with
npm) is served from disk, so nothing is fetched from the network. The notebook is
exported twice, with JupyterLab's light and dark themes (nbconvert's lab template carries
both), and every label of its outputs must read in each (WCAG AA).
"""

import os
import shutil

import pytest
from chromium import artifact, browser, contrast_report, missing
from test_notebooks import HERE, execute

WIDGETS = os.path.join(HERE, ".cache", "widgets", "node_modules")
RENDERER = os.path.join(WIDGETS, "@jupyter-widgets", "html-manager", "dist")
REQUIRE = os.path.join(WIDGETS, "requirejs", "require.js")


def _missing() -> str | None:
    if not os.path.exists(os.path.join(RENDERER, "embed-amd.js")):
        return "the widget renderer is not installed (scripts/test.sh installs it with npm)"
    return missing("nbconvert")


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The executed notebook as a page per JupyterLab theme (index.html: light, dark.html: dark)."""
    from nbconvert import HTMLExporter

    site = tmp_path_factory.mktemp("site")
    nb = execute("05_visualize.ipynb")
    assert nb.metadata.get("widgets"), "nbclient stored no widget state"
    for theme, name in (("light", "index.html"), ("dark", "dark.html")):
        exporter = HTMLExporter(template_name="lab", theme=theme, require_js_url="require.js",
                                widget_renderer_url="embed-amd.js")
        body, _ = exporter.from_notebook_node(nb)
        (site / name).write_text(body)
    shutil.copytree(RENDERER, site, dirs_exist_ok=True)
    shutil.copy(REQUIRE, site / "require.js")
    return site


@pytest.fixture(scope="module")
def page(site):
    with browser() as chromium:
        tab = chromium.new_page(viewport={"width": 1400, "height": 1000})
        tab.goto(f"file://{site}/index.html")
        tab.wait_for_selector(".mk-rank", timeout=60_000)
        yield tab, site


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_executed_notebook_reads_in_both_themes(site, theme):
    with browser() as chromium:
        tab = chromium.new_page(viewport={"width": 1400, "height": 1000})
        tab.goto(f"file://{site}/{'index' if theme == 'light' else 'dark'}.html")
        tab.wait_for_selector(".widget-gridbox .mk-rank", timeout=60_000)  # the live widgets rendered
        background = tab.evaluate("getComputedStyle(document.body).backgroundColor")
        measured = contrast_report(tab, ".jp-OutputArea-output *")
        tab.screenshot(path=artifact(f"05_visualize_{theme}.png"), full_page=True)
    levels = [int(v) for v in background[background.index("(") + 1:background.index(")")].split(",")[:3]]
    assert (sum(levels) / 3 < 100) == (theme == "dark"), background  # the theme really is the one asked for
    kinds = {kind: [m for m in measured if kind in m["path"]] for kind in ("mk-rank", "mk-timing-row", "mk-block")}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}  # tiles, timing labels, sharding blocks
    poor = [m for m in measured if m["ratio"] < 4.5]
    assert not poor, poor[:10]


def test_mesh_grid_renders_every_rank(page):
    tab, site = page
    cards = tab.locator(".mk-rank")
    assert cards.count() == 8  # two live views: after %mesh up, and %mesh status
    assert sorted(int(cards.nth(i).get_attribute("data-rank")) for i in range(4)) == [0, 1, 2, 3]
    assert {cards.nth(i).get_attribute("data-state") for i in range(4)} <= {"idle", "busy"}
    assert "localhost:2 (rank 2)" in cards.nth(2).inner_text()
    tab.locator(".widget-gridbox").last.screenshot(path=str(site / "mesh.png"))
    assert (site / "mesh.png").stat().st_size > 1000


def test_sharding_views_render_their_blocks(page):
    tab, site = page
    blocks = tab.locator(".mk-block")
    found = {(blocks.nth(i).get_attribute("data-ranks"), blocks.nth(i).get_attribute("data-rows"),
              blocks.nth(i).get_attribute("data-cols")) for i in range(blocks.count())}
    # weights [6, 8] on a 2x2 mesh: Shard(0), Shard(1)
    assert {("0", "0:3", "0:4"), ("1", "0:3", "4:8"), ("2", "3:6", "0:4"), ("3", "3:6", "4:8")} <= found
    # uneven [5, 3] over 4 ranks: 2, 2, 1, 0 rows
    assert {("0", "0:2", "0:3"), ("1", "2:4", "0:3"), ("2", "4:5", "0:3")} <= found
    assert ("0,1,2,3", "0:4", "0:4") in found  # the Partial tensor, on every rank
    assert "empty shards (no elements): localhost:3 (rank 3)" in tab.locator(".mk-sharding").nth(1).inner_text()
    assert "Σ Partial(sum)" in tab.locator(".mk-sharding").nth(2).inner_text()
    tab.locator(".mk-sharding").first.screenshot(path=str(site / "sharding.png"))
    assert (site / "sharding.png").stat().st_size > 1000


def test_screenshots_are_kept_as_artifacts(page):
    _, site = page
    for name in ("mesh.png", "sharding.png"):
        if (site / name).exists():
            shutil.copy(site / name, artifact(f"05_visualize_{name}"))
    assert os.path.exists(artifact("05_visualize_sharding.png"))


def test_timing_bars_mark_the_straggler(page):
    tab, _ = page
    rows = tab.locator(".mk-timing-row")
    last = rows.count() - 1  # the straggler cell is the last one with bars
    assert last >= 3 and rows.count() % 4 == 0
    assert "straggler" in rows.nth(last).inner_text() and "straggler" not in rows.nth(last - 3).inner_text()
    assert rows.nth(last).get_attribute("data-rank") == "3"
