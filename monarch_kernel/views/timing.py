"""Per-rank timing of one run: a bar per rank, stragglers and failures marked.

Shown after each `%%mesh` cell (off with `%mesh config timing off`); the same records
are kept in `mesh.history()`.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.core.timing import RankTiming
from monarch_kernel.views import theme
from monarch_kernel.views.base import TextHtmlView

MIN_SHOWN_S = 0.1  # runs faster than this on every rank (and without failures) show no bars
STRAGGLER_FACTOR = 1.5
MIN_STRAGGLER_GAP_S = 0.02  # a rank must also be this much slower to count as a straggler
BAR_CHARS = 30


@dataclass(frozen=True)
class RankTime:
    """One rank's duration (None: it died or never answered) and whether it succeeded."""

    rank: int
    label: str
    seconds: float | None
    ok: bool


class TimingView(TextHtmlView):
    """Bars of how long each rank took; text in terminals, HTML in notebooks."""

    def __init__(self, title: str, times: list[RankTime], straggler_factor: float = STRAGGLER_FACTOR):
        self.title = title
        self.times = times
        known = [t.seconds for t in times if t.seconds is not None]
        self.median = statistics.median(known) if known else None
        self.longest = max(known, default=0.0)
        self.straggler_factor = straggler_factor

    def is_straggler(self, t: RankTime) -> bool:
        """Slower than factor x the median (and noticeably so)."""
        return (t.seconds is not None and self.median is not None and len(self.times) > 2
                and t.seconds > self.straggler_factor * self.median
                and t.seconds - self.median > MIN_STRAGGLER_GAP_S)

    def stragglers(self) -> list[int]:
        """Ranks that took far longer than the median."""
        return [t.rank for t in self.times if self.is_straggler(t)]

    def _note(self, t: RankTime) -> str:
        if t.seconds is None:
            return "no answer (died or lost)"
        notes = []
        if not t.ok:
            notes.append("failed")
        if self.is_straggler(t) and self.median:
            notes.append(f"straggler, {t.seconds / self.median:.1f}x median")
        return ", ".join(notes)

    def heading(self) -> str:
        """The title, with the median."""
        return f"{self.title}: median {_seconds(self.median)}" if self.median is not None else self.title

    def _line(self, t: RankTime, width: int) -> str:
        filled = 0 if not t.seconds or not self.longest else max(1, round(BAR_CHARS * t.seconds / self.longest))
        bar = "#" * filled + "." * (BAR_CHARS - filled)
        note = self._note(t)
        return f"  {t.label.ljust(width)}  {bar}  {_seconds(t.seconds)}" + (f"  <- {note}" if note else "")

    def text(self) -> str:
        """One line per rank: label, bar, duration, notes."""
        width = max(len(t.label) for t in self.times) if self.times else 0
        lines = [self.heading()]
        lines += [self._line(t, width) for t in self.times]
        return "\n".join(lines)

    def html(self) -> str:
        """Compact bars, red for failures, orange for stragglers."""
        rows = []
        for t in self.times:
            pct = 0 if not t.seconds or not self.longest else max(1, round(100 * t.seconds / self.longest))
            colour = "#d62728" if not t.ok else "#ff7f0e" if self.is_straggler(t) else "#4e79a7"
            note = self._note(t)
            marks = "".join(
                f"<span class='{cls}' title='{title}' style='position:absolute;top:-2px;height:12px;left:{at:.1f}%;"
                f"border-left:2px {style} {theme.TEXT}'></span>"
                for cls, title, at, style in self._marks())
            rows.append(
                f"<div class='mk-timing-row' data-rank='{t.rank}' style='display:flex;align-items:center;gap:6px'>"
                f"<span style='width:14em;font:11px {theme.MONO}'>{html.escape(t.label)}</span>"
                f"<span style='position:relative;display:inline-block;width:200px;background:{theme.TRACK};height:8px'>"
                f"<span style='display:block;width:{pct}%;height:8px;background:{colour}'></span>{marks}</span>"
                f"<span style='font:11px {theme.MONO}'>{_seconds(t.seconds)} {html.escape(note)}</span></div>")
        head = html.escape(self.heading())
        legend = ("" if self.median is None or not self.longest else
                  " (solid mark: median; dashed: the straggler threshold)")
        return (f"<div class='mk-timing' style='color:{theme.TEXT}'><div style='font:11px {theme.FONT}'>{head}"
                f"{legend}</div>{''.join(rows)}</div>")

    def _marks(self) -> list[tuple[str, str, float, str]]:
        """Where the median and the straggler threshold fall on the bars (percent of the longest)."""
        if self.median is None or not self.longest:
            return []
        marks = [("mk-median", f"median {_seconds(self.median)}", 100 * self.median / self.longest, "solid")]
        threshold = max(self.median * self.straggler_factor, self.median + MIN_STRAGGLER_GAP_S)
        if threshold <= self.longest:
            marks.append(("mk-threshold", f"straggler beyond {_seconds(threshold)}", 100 * threshold / self.longest,
                          "dashed"))
        return marks

    def __rich__(self) -> Any:
        from rich.text import Text

        width = max(len(t.label) for t in self.times) if self.times else 0
        out = Text(self.heading() + "\n", style="dim")
        for t in self.times:
            style = "red" if not t.ok else "yellow" if self.is_straggler(t) else "blue"
            out.append(self._line(t, width) + "\n", style=style)
        return out


def run_timing_view(title: str, times: list[RankTiming],
                    labels: Callable[[], dict[int, str]]) -> TimingView | None:
    """The bars of a run of several ranks, or None when they are not worth showing.

    A run that took under MIN_SHOWN_S on every rank without failing needs no bars (its
    times are still in `mesh.history()`). `labels` is asked only for runs worth showing.
    """
    slowest = max((sec for _, sec, _ in times if sec is not None), default=None)
    if len(times) < 2 or (slowest is not None and slowest < MIN_SHOWN_S and all(ok for _, _, ok in times)):
        return None
    names = labels()
    return TimingView(f"{title} per rank", [RankTime(r, names.get(r, f"rank {r}"), sec, ok) for r, sec, ok in times])


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.0f} ms"
