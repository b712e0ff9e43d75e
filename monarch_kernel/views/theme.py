"""Colours of the HTML views, from JupyterLab's theme (light or dark), with fallbacks elsewhere.

Text and surfaces use JupyterLab's CSS variables (`--jp-ui-font-color*`, `--jp-layout-color*`,
`--jp-border-color*`), so they follow the theme; the fallbacks are the light theme's values,
for exported HTML and the classic Notebook. Rank states are badges: a fixed dark colour with
white text (AA contrast whatever the theme) that also carries a glyph and the word, so no
state is told by colour alone. Coloured blocks (sharding) get black or white text, whichever
contrasts more with their colour.
"""

from __future__ import annotations

from monarch_kernel.core.status import RankStatus

TEXT = "var(--jp-ui-font-color1, rgba(0, 0, 0, 0.87))"  # (the theme's secondary colours miss AA on cards)
SURFACE = "var(--jp-layout-color1, #ffffff)"
CARD = "var(--jp-layout-color2, #eeeeee)"
TRACK = "var(--jp-layout-color3, #bdbdbd)"
BORDER = "var(--jp-border-color1, #bdbdbd)"
FONT = "var(--jp-ui-font-family, system-ui, -apple-system, 'Segoe UI', sans-serif)"
MONO = "var(--jp-code-font-family, monospace)"

# state -> (badge colour, glyph); white text on each is at least 4.5:1
STATES: dict[str, tuple[str, str]] = {
    RankStatus.IDLE: ("#1b5e20", "\u25cf"),  # ● idle
    RankStatus.BUSY: ("#0d47a1", "\u25b6"),  # ▶ busy
    RankStatus.DEAD: ("#b71c1c", "\u2716"),  # ✖ dead
    RankStatus.UNRESPONSIVE: ("#8d3c00", "\u26a0"),  # ⚠ unresponsive
    RankStatus.STARTING: ("#424242", "\u2026"),  # … starting
}
STATE_GLYPHS: dict[str, str] = {state: glyph for state, (_colour, glyph) in STATES.items()}  # also sent to the sidebar
WARNING = "#b71c1c"  # badges that warn (little time left on an allocation)


def state_colour(state: str) -> str:
    """The badge colour of a rank state (grey for one it does not know)."""
    return STATES.get(state, ("#424242", "?"))[0]


def state_badge(state: str) -> str:
    """A rank state as a badge: glyph and word, white on the state's colour."""
    colour, glyph = STATES.get(state, ("#424242", "?"))
    return (f"<span class='mk-state' style='background:{colour};color:#ffffff;border-radius:3px;padding:0 4px;"
            f"font-weight:600'>{glyph} {state}</span>")


def badge(text: str, colour: str) -> str:
    """White text on a colour (already HTML-escaped text)."""
    return (f"<span class='mk-badge' style='background:{colour};color:#ffffff;border-radius:3px;padding:0 4px;"
            f"font-weight:600'>{text}</span>")


def _linear(channel: int) -> float:
    c = channel / 255
    return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4


def luminance(colour: str) -> float:
    """Relative luminance (WCAG) of a #rrggbb colour."""
    value = colour.lstrip("#")
    r, g, b = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return 0.2126 * _linear(r) + 0.7152 * _linear(g) + 0.0722 * _linear(b)


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two #rrggbb colours (1 to 21)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_on(*backgrounds: str) -> str:
    """Black or white: whichever reads better on every one of some #rrggbb backgrounds (a gradient's stops)."""
    black = min(contrast(b, "#000000") for b in backgrounds)
    white = min(contrast(b, "#ffffff") for b in backgrounds)
    return "#000000" if black >= white else "#ffffff"


def lighter(colour: str, amount: float) -> str:
    """colour mixed with white (amount 0 to 1), as a light overlay draws it."""
    value = colour.lstrip("#")
    r, g, b = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in (r, g, b))


def swatch(colour: str) -> str:
    """A small square of a colour, beside a label in the theme's text colour."""
    return (f"<span style='display:inline-block;width:.8em;height:.8em;background:{colour};"
            f"border:1px solid {BORDER};vertical-align:-1px;margin-right:3px'></span>")
