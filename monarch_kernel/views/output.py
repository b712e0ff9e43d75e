"""The model of a run's text output: lines grouped across ranks, and its rendering.

Each rank's text is cut into lines. While a run is live, a line joins an existing group
with the same text when that rank has not contributed to it yet and the group comes
after the rank's previous line (O(1) per line). When the run ends, the groups are
rebuilt by aligning the ranks' line sequences (longest common subsequences), so rank-
specific lines sit next to each other between the shared ones. Both keep each rank's
order while identical lines collapse into one, tagged with the rank set
(`[0-3] loss 0.25`). Carriage returns rewrite a line as in a terminal, and each rank's
unfinished line (a progress bar) is shown live after the others.
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from monarch_kernel.core.ranksets import compact_ranks
from monarch_kernel.core.termtext import OPEN_LINE_MAX, open_line, shown_line

MAX_SHOWN_LINES = 10_000
MAX_SHOWN_CHARS = 2_000_000
REALIGN_MAX_LINES = 20_000


@dataclass(slots=True)
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
        self._by_key: dict[tuple, list[int]] = {}
        self._cursor: dict[tuple, int] = {}
        self._done: set[int] = set()
        self._lines: dict[int, list[tuple[str, str]]] = defaultdict(list)
        self.dropped_lines = 0
        self.dropped_chars = 0
        self._chars = 0
        self.version = 0

    def add(self, rank: int, stream: str, text: str) -> None:
        """Add text a rank wrote; complete lines are grouped now, the rest waits."""
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        pieces = text.split("\n")
        rest = pieces.pop()
        if rest:
            rest = open_line(rest)
            if len(rest) > OPEN_LINE_MAX:  # a line without end (a C library's output): keep its start
                self.dropped_chars += len(rest) - OPEN_LINE_MAX
                rest = rest[:OPEN_LINE_MAX]
            self._partial[key] = rest
            self.version += 1  # the rank's unfinished line (a progress bar) is shown as it changes
        if "\r" in text:
            pieces = [shown_line(piece) for piece in pieces]
        if any(len(piece) > OPEN_LINE_MAX for piece in pieces):
            pieces = [self._cut(piece) for piece in pieces]
        start = self._follow(rank, stream, pieces) if self.dedupe and stream != "notice" else 0
        add_line = self._add_line
        for line in pieces[start:]:
            add_line(rank, stream, line)

    def _cut(self, line: str) -> str:
        """A line of at most OPEN_LINE_MAX characters; what is cut counts as dropped."""
        if len(line) <= OPEN_LINE_MAX:
            return line
        self.dropped_chars += len(line) - OPEN_LINE_MAX
        return line[:OPEN_LINE_MAX]

    def _follow(self, rank: int, stream: str, lines: list[str]) -> int:
        """Fast path: join the groups right after the rank's last line while they match.

        This is what happens for every rank but the first when ranks print the same
        lines; returns how many lines were placed.
        """
        groups, last, placed = self.groups, self._last_pos[rank], 0
        for line in lines:
            nxt = last + 1
            if nxt >= len(groups):
                break
            group = groups[nxt]
            if group.text != line or group.stream != stream or rank in group.ranks:
                break
            group.ranks.append(rank)
            last = nxt
            placed += 1
        if placed:
            self._last_pos[rank] = last
            self._lines[rank].extend((stream, line) for line in lines[:placed])
            self.version += 1
        return placed

    def notice(self, rank: int, text: str) -> None:
        """Add a message about a rank (shown as its own line)."""
        for line in text.splitlines() or [""]:
            self._add_line(rank, "notice", line)

    def finish_rank(self, rank: int) -> None:
        """The rank is done: its unfinished lines count as complete."""
        for stream in ("stdout", "stderr"):
            rest = self._partial.pop((rank, stream), None)
            if rest is not None and shown_line(rest):
                self._add_line(rank, stream, shown_line(rest))
        self._done.add(rank)

    def finish(self, *, realign: bool = True) -> None:
        """Every rank is done; with realign, regroup by aligning whole rank sequences."""
        for rank, _ in sorted(self._partial):
            self.finish_rank(rank)
        self._done.update(self.all_ranks)
        total = sum(len(v) for v in self._lines.values())
        printing = len(self._lines)
        if all(len(g.ranks) == printing for g in self.groups):
            return  # every rank printed the same lines: the live grouping is already aligned
        if realign and self.dedupe and printing > 1 and total <= REALIGN_MAX_LINES:
            self.groups = _align(dict(sorted(self._lines.items())))  # rank-specific lines in rank order
            self.version += 1

    def open_lines(self) -> list[Group]:
        """Each rank's unfinished line as it shows now (e.g. a progress bar), grouped like lines."""
        shown: list[Group] = []
        by_key: dict[tuple, Group] = {}
        for (rank, stream), partial in sorted(self._partial.items()):
            text = shown_line(partial)
            if not text.strip():
                continue
            key = (stream, text) if self.dedupe else (stream, text, rank)
            group = by_key.get(key)
            if group is None:
                group = by_key[key] = Group(stream, text, [rank])
                shown.append(group)
            else:
                group.ranks.append(rank)
        return shown

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
        groups = self.groups
        last = self._last_pos[rank]
        pos = -1
        if key.__len__() == 2 and last + 1 < len(groups):
            following = groups[last + 1]  # fast path: the rank repeats what another printed
            if following.text == line and following.stream == stream and rank not in following.ranks:
                pos = last + 1
                following.ranks.append(rank)
        candidates = self._by_key.get(key) if pos < 0 else None
        if candidates is not None:
            cursor_key = (key, rank)
            i = self._cursor.get(cursor_key, 0)
            while i < len(candidates) and (candidates[i] <= last or rank in groups[candidates[i]].ranks):
                i += 1
            self._cursor[cursor_key] = i
            if i < len(candidates):
                pos = candidates[i]
                groups[pos].ranks.append(rank)
        if pos < 0:
            pos = len(groups)
            groups.append(Group(stream, line, [rank]))
            self._by_key.setdefault(key, []).append(pos)
            self._chars += len(line) + 1
        self._last_pos[rank] = pos
        self._lines[rank].append((stream, line))
        self.version += 1


def _align(per_rank: dict[int, list[tuple[str, str]]]) -> list[Group]:
    """Merge rank line sequences: common subsequences become shared groups."""
    merged: list[Group] = []
    for rank, seq in per_rank.items():
        # notices never match one another (each says something about its own rank): keys of their own
        keys = [(g.stream, g.text) if g.stream != "notice" else ("notice", id(g)) for g in merged]
        mine = [(st, tx) if st != "notice" else ("notice of", rank * 1_000_000 + j) for j, (st, tx) in enumerate(seq)]
        if mine == keys:  # the common case: this rank printed exactly what the others did
            for group in merged:
                group.ranks.append(rank)
            continue
        rebuilt: list[Group] = []
        matcher = SequenceMatcher(None, keys, mine, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                for group in merged[i1:i2]:
                    group.ranks.append(rank)
                    rebuilt.append(group)
                continue
            rebuilt.extend(merged[i1:i2])
            rebuilt.extend(Group(st, tx, [rank]) for st, tx in seq[j1:j2])
        merged = rebuilt
    return merged


def _tag(group: Group, cache: dict | None = None, among: list[int] | None = None) -> str:
    """`[0-3]`, `[all but 64]`, `[0-126 step 2]`: the shortest name of the group's ranks."""
    if cache is None:
        return f"[{compact_ranks(group.ranks, among or ())}]"
    key = tuple(group.ranks)
    tag = cache.get(key)
    if tag is None:
        tag = cache[key] = f"[{compact_ranks(group.ranks, among or ())}]"
    return tag


def _dropped_note(model: OutputGroups) -> str:
    if not model.dropped_chars:
        return ""
    if not model.dropped_lines:  # only the ends of very long lines were cut
        return (f"[monarch_kernel: {model.dropped_chars:,} characters of lines longer than "
                f"{OPEN_LINE_MAX:,} not shown]")
    return (f"[monarch_kernel: {model.dropped_lines:,} more lines ({model.dropped_chars:,} characters) "
            f"not shown; see %mesh logs for the latest lines of a rank]")


def render_text(model: OutputGroups, start: int = 0, stop: int | None = None, *, tail: bool = True) -> str:
    """Plain text of groups[start:stop], each line tagged with its ranks.

    With `tail`, unfinished lines (progress bars) and the note on dropped lines follow.
    """
    groups = model.groups[start:stop] + (model.open_lines() if tail else [])
    if not groups:
        return _dropped_note(model) if tail else ""
    cache: dict = {}
    tags = [_tag(g, cache, model.all_ranks) for g in groups]
    width = max(map(len, tags))
    markers = {"notice": "!", "stderr": ":", "stdout": " "}
    lines = [f"{tag.ljust(width)}{markers[g.stream]}{g.text}" for tag, g in zip(tags, groups)]
    note = _dropped_note(model) if tail else ""
    return "\n".join(lines + ([note] if note else []))


_STYLE = {
    "stdout": "",
    "stderr": "background:var(--jp-rendermime-error-background,#fdd);",
    "notice": "color:var(--jp-error-color1,#b00);font-weight:bold;",
}


def render_html(model: OutputGroups) -> str:
    """HTML of all groups: rank tags dimmed, stderr shaded, notices in red."""
    groups = model.groups + model.open_lines()
    if not groups:
        return ""
    cache: dict = {}
    width = max(len(_tag(g, cache, model.all_ranks)) for g in groups)
    rows = []
    for g in groups:
        tag = html.escape(_tag(g, cache, model.all_ranks).ljust(width))
        rows.append(f"<span style='{_STYLE[g.stream]}'><span style='opacity:.55'>{tag}</span> "
                    f"{html.escape(g.text)}</span>")
    note = _dropped_note(model)
    if note:
        rows.append(f"<i>{html.escape(note)}</i>")
    return ("<pre class='monarch-output' style='margin:0;white-space:pre-wrap'>"
            + "\n".join(rows) + "</pre>")
