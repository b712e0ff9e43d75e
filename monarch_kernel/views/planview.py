"""A plan drawn: each candidate layout's memory per rank as a bar split by category against the
memory a rank has, whether it fits (a badge with a glyph and the word), its estimated and
measured step, and why a layout does not fit or does not apply.

Every bar is drawn to one scale (the largest peak or the memory per rank, whichever is larger),
with a line where the memory per rank ends, so layouts compare at a glance; each segment's
category and size are in the legend and in its tooltip, never in its colour alone.
"""

from __future__ import annotations

import html
from typing import Any

from monarch_kernel.planner.hardware import CATEGORIES, size_text
from monarch_kernel.views import theme
from monarch_kernel.views.base import TextHtmlView

CATEGORY_COLOURS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f", "activations": "#e15759",
                    "temporary": "#76b7b2", "buffers": "#b07aa1"}
FITS = ("#1b5e20", "\u2714 fits")
TOO_BIG = ("#b71c1c", "\u2716 too big")
NOT_APPLICABLE = ("#424242", "\u2013 n/a")
BAR_PX = 220


class PlanView(TextHtmlView):
    """The view of a `Plan` (monarch_kernel.api.planning)."""

    def __init__(self, plan: Any):
        self.plan = plan

    def text(self) -> str:
        """The plan's table (as `str(plan)`)."""
        return str(self.plan)

    def _scale(self) -> float:
        peaks = [c.peak_bytes for c in self.plan.candidates if c.applicable]
        return float(max([self.plan.figures.memory, *peaks], default=1) or 1)

    def _bar(self, candidate: Any, scale: float) -> str:
        segments = []
        for category in CATEGORIES:
            size = candidate.memory.get(category, 0)
            if size <= 0:
                continue
            width = max(1.0, BAR_PX * size / scale)
            tip = html.escape(f"{category}: {size_text(size)}")
            segments.append(f"<span title='{tip}' style='display:inline-block;height:12px;width:{width:.1f}px;"
                            f"background:{CATEGORY_COLOURS[category]}'></span>")
        limit = BAR_PX * self.plan.figures.memory / scale
        return (f"<div style='position:relative;width:{BAR_PX}px;height:12px;background:{theme.CARD};"
                f"white-space:nowrap;overflow:hidden'>{''.join(segments)}"
                f"<span title='memory per rank: {html.escape(size_text(self.plan.figures.memory))}' "
                f"style='position:absolute;left:{limit:.1f}px;top:-2px;height:16px;border-left:2px solid {theme.TEXT}'>"
                f"</span></div>")

    def _row(self, candidate: Any, scale: float, best: str | None) -> str:
        cell = f"style='padding:2px 8px;border-bottom:1px solid {theme.BORDER};color:{theme.TEXT};white-space:nowrap'"
        why = cell.replace(";white-space:nowrap", "")
        name = html.escape(candidate.layout) + (" \u2605 best" if candidate.layout == best else "")
        if not candidate.applicable:
            colour, word = NOT_APPLICABLE
            return (f"<tr><td {cell}><code>{name}</code></td><td {cell}>{theme.badge(word, colour)}</td>"
                    f"<td {cell} colspan='4'></td><td {why}>{html.escape(candidate.reason)}</td></tr>")
        colour, word = FITS if candidate.fits else TOO_BIG
        measured = ""
        if candidate.measured_step_seconds is not None:
            measured = (f"{candidate.measured_step_seconds * 1e3:.1f} ms, "
                        f"{size_text(candidate.measured_peak_bytes or 0)}")
        return (f"<tr><td {cell}><code>{name}</code></td><td {cell}>{theme.badge(word, colour)}</td>"
                f"<td {cell}>{self._bar(candidate, scale)}</td><td {cell}>{html.escape(size_text(candidate.peak_bytes))}"
                f"</td><td {cell}>{candidate.step_seconds * 1e3:.1f} ms</td><td {cell}>{html.escape(measured)}</td>"
                f"<td {why}>{html.escape(candidate.reason)}</td></tr>")

    def legend(self) -> str:
        """The categories' colours, named."""
        items = [f"{theme.swatch(CATEGORY_COLOURS[c])}{c}" for c in CATEGORIES]
        items.append(f"<span style='border-left:2px solid {theme.TEXT};margin:0 4px'></span>memory per rank")
        return f"<div style='margin:4px 0;color:{theme.TEXT}'>{' &nbsp; '.join(items)}</div>"

    def html(self) -> str:
        """The table with its bars, the legend and the plan's notes."""
        plan = self.plan
        best = plan.best.layout if plan.best else None
        head = html.escape(str(plan).splitlines()[0])
        scale = self._scale()
        header_cell = f"style='text-align:left;padding:2px 8px;border-bottom:2px solid {theme.BORDER};white-space:nowrap'"
        headers = "".join(f"<th {header_cell}>{h}</th>" for h in
                          ("layout", "fits", "memory per rank", "peak", "step (est.)", "measured", "why"))
        rows = "".join(self._row(c, scale, best) for c in plan.candidates)
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in plan.notes)
        return (f"<div class='mk-plan' style='font-family:{theme.FONT};color:{theme.TEXT};background:{theme.SURFACE}'>"
                f"<div style='font-weight:600;margin-bottom:4px'>{head}</div>"
                f"<table style='border-collapse:collapse'><tr>{headers}</tr>{rows}</table>"
                f"{self.legend()}{notes}</div>")
