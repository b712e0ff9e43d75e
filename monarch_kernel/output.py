"""The model of a run's text output: lines grouped across ranks, and its rendering.

Each rank's text is cut into lines. A line joins an existing group with the same text
when that rank has not contributed to it yet and the group comes after the rank's
previous line, so per-rank order is always preserved while identical lines from many
ranks collapse into one, tagged with the rank set (`[0-3] loss 0.25`).
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field

from .shape import format_ranks

MAX_SHOWN_LINES = 10_000
MAX_SHOWN_CHARS = 2_000_000


@dataclass
class Group:
    """One shown line and the ranks that printed it."""

    stream: str  # stdout, stderr or notice
    text: str
    ranks: list[int] = field(default_factory=list)


class OutputGroups:
    """Incrementally groups the lines of several ranks (thread-confined)."""

    def __init__(self, ranks: tuple[int, ...] | list[int], *, dedupe: bool = True):
        self.all_ranks = list(ranks)
        self.dedupe = dedupe
        self.groups: list[Group] = []
        self._partial: dict[tuple[int, str], str] = {}
        self._last_pos: dict[int, int] = defaultdict(lambda: -1)
        self._by_key: dict[tuple, list[int]] = defaultdict(list)
        self._cursor: dict[tuple, int] = defaultdict(int)
        self._done: set[int] = set()
        self.dropped_lines = 0
        self.dropped_chars = 0
        self._chars = 0
        self.version = 0

    def add(self, rank: int, stream: str, text: str) -> None:
        """Add text a rank wrote; complete lines are grouped now, the rest waits."""
        key = (rank, stream)
        pieces = (self._partial.pop(key, "") + text).split("\n")
        rest = pieces.pop()
        if rest:
            self._partial[key] = rest
        for line in pieces:
            self._add_line(rank, stream, line)

    def notice(self, rank: int, text: str) -> None:
        """Add a message about a rank (shown as its own line)."""
        for line in text.splitlines() or [""]:
            self._add_line(rank, "notice", line)

    def finish_rank(self, rank: int) -> None:
        """The rank is done: its unfinished lines count as complete."""
        for stream in ("stdout", "stderr"):
            rest = self._partial.pop((rank, stream), None)
            if rest is not None:
                self._add_line(rank, stream, rest)
        self._done.add(rank)

    def finish(self) -> None:
        """Every rank is done."""
        for rank, _ in sorted(self._partial):
            self.finish_rank(rank)
        self._done.update(self.all_ranks)

    def settled(self) -> int:
        """How many leading groups can no longer change (every running rank is past them)."""
        running = [r for r in self.all_ranks if r not in self._done]
        if not running:
            return len(self.groups)
        return max(0, min(self._last_pos[r] for r in running) + 1)

    def _add_line(self, rank: int, stream: str, line: str) -> None:
        if len(self.groups) >= MAX_SHOWN_LINES or self._chars >= MAX_SHOWN_CHARS:
            self.dropped_lines += 1
            self.dropped_chars += len(line) + 1
            self.version += 1
            return
        key = (stream, line) if self.dedupe and stream != "notice" else (stream, line, rank)
        candidates = self._by_key[key]
        cursor_key = (key, rank)
        i = self._cursor[cursor_key]
        last = self._last_pos[rank]
        while i < len(candidates) and (candidates[i] <= last or rank in self.groups[candidates[i]].ranks):
            i += 1
        self._cursor[cursor_key] = i
        if i < len(candidates):
            pos = candidates[i]
            self.groups[pos].ranks.append(rank)
        else:
            pos = len(self.groups)
            self.groups.append(Group(stream, line, [rank]))
            candidates.append(pos)
            self._chars += len(line) + 1
        self._last_pos[rank] = pos
        self.version += 1


def _tag(group: Group) -> str:
    return f"[{format_ranks(group.ranks)}]"


def _dropped_note(model: OutputGroups) -> str:
    if not model.dropped_lines:
        return ""
    return (f"[monarch_kernel: {model.dropped_lines:,} more lines ({model.dropped_chars:,} characters) "
            f"not shown; see %mesh logs for the latest lines of a rank]")


def render_text(model: OutputGroups, start: int = 0, stop: int | None = None, *, tail: bool = True) -> str:
    """Plain text of groups[start:stop], each line tagged with its ranks."""
    groups = model.groups[start:stop]
    if not groups:
        return _dropped_note(model) if tail else ""
    width = max(len(_tag(g)) for g in groups)
    lines = []
    for g in groups:
        marker = "!" if g.stream == "notice" else (":" if g.stream == "stderr" else " ")
        lines.append(f"{_tag(g).ljust(width)}{marker}{g.text}")
    note = _dropped_note(model) if tail else ""
    return "\n".join(lines + ([note] if note else []))


_STYLE = {
    "stdout": "",
    "stderr": "background:var(--jp-rendermime-error-background,#fdd);",
    "notice": "color:var(--jp-error-color1,#b00);font-weight:bold;",
}


def render_html(model: OutputGroups) -> str:
    """HTML of all groups: rank tags dimmed, stderr shaded, notices in red."""
    if not model.groups:
        return ""
    width = max(len(_tag(g)) for g in model.groups)
    rows = []
    for g in model.groups:
        tag = html.escape(_tag(g).ljust(width))
        rows.append(f"<span style='{_STYLE[g.stream]}'><span style='opacity:.55'>{tag}</span> "
                    f"{html.escape(g.text)}</span>")
    note = _dropped_note(model)
    if note:
        rows.append(f"<i>{html.escape(note)}</i>")
    return ("<pre class='monarch-output' style='margin:0;white-space:pre-wrap'>"
            + "\n".join(rows) + "</pre>")
