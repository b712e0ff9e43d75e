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


def contrast_report(tab, selector: str) -> list[dict]:
    """For every visible element under `selector` with text of its own: the WCAG contrast of its
    computed colour over its computed background (composited through translucent ancestors; every
    stop of a gradient, with any translucent hatch over it, is checked and the worst one kept), and the
    classes of it and its nearest ancestors (`path`), to tell which view a label belongs to."""
    return tab.evaluate(_CONTRAST_JS, selector)


_CONTRAST_JS = """
(selector) => {
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
  for (const el of document.querySelectorAll(selector)) {
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
    const path = [];  // the classes of the element and its ancestors: which view a label belongs to
    for (let node = el; node && node.nodeType === 1 && path.length < 8; node = node.parentElement) {
      if (typeof node.className === 'string' && node.className) path.push(node.className);
    }
    out.push({text: own.join(' ').slice(0, 40), ratio: worst, cls: el.className || el.tagName, path: path.join(' < ')});
  }
  return out;
}
"""
