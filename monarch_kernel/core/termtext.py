"""Carriage returns as a terminal (and Jupyter) shows them: progress bars rewrite a line.

tqdm and hand-written progress output print `\\r<new state>` without a newline, many
times a second. A line's text is what follows its last carriage return; everything
before it was overwritten on screen. These helpers apply that rule where rank output is
kept (the live view, rank logs, crash tails) and where it is sent (ranks drop the states
a later one already replaced, so a long progress bar costs one state per flush).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

PROGRESS_PIECE_MAX = 1_000  # a rewrite of a line longer than this counts as output, not progress
OPEN_LINE_MAX = 64 << 10  # an unfinished line keeps its last 64 KiB (a line is for reading, not storage)


def shown_line(line: str) -> str:
    """What a terminal shows for a complete line: the text after its last carriage return."""
    kept = line.rstrip("\r")
    cut = kept.rfind("\r")
    return kept[cut + 1:] if cut >= 0 else kept


def open_line(partial: str) -> str:
    """An unfinished line, cut to its last rewrite; keeps the `\\r` that marks the rewrite."""
    cut = partial.rstrip("\r").rfind("\r")
    return partial[cut:] if cut > 0 else partial


def compact(text: str) -> str:
    """Text with every overwritten state of each line left out (what is left to send)."""
    if "\r" not in text:
        return text
    return "\n".join(open_line(piece) for piece in text.split("\n"))


def progress_chars(text: str) -> int:
    """How many characters of `text` only rewrite a line (short pieces that start with `\\r`)."""
    return sum(len(piece) for piece in text.split("\n")
               if piece.startswith("\r") and len(piece) <= PROGRESS_PIECE_MAX)


class LineLog:
    """The last lines of one rank's streams, with progress rewrites applied.

    Complete lines go into a bounded deque of (stream, line); each stream's unfinished
    line is kept aside and shown after them.
    """

    def __init__(self, maxlen: int):
        self.lines: deque[tuple[str, str]] = deque(maxlen=maxlen)
        self._open: dict[str, str] = {}

    def write(self, stream: str, text: str) -> None:
        """Add text a rank wrote to `stream`."""
        *complete, rest = (self._open.pop(stream, "") + text).split("\n")
        self.lines.extend((stream, shown) for shown in map(shown_line, complete) if shown.strip())
        if rest:
            # bounded, so that output without newlines (32 MiB from a C library, say) costs
            # linear time instead of copying the growing line at every chunk
            self._open[stream] = open_line(rest)[-OPEN_LINE_MAX:]

    def append(self, entry: tuple[str, str]) -> None:
        """Add one complete (stream, line)."""
        self.lines.append(entry)

    def tail(self, count: int | None = None) -> list[tuple[str, str]]:
        """The last `count` lines (all by default), unfinished ones last."""
        shown = [(stream, shown_line(text)) for stream, text in self._open.items()]
        entries = list(self.lines) + [(s, t) for s, t in shown if t.strip()]
        return entries if count is None else entries[-count:] if count > 0 else []

    def texts(self) -> list[str]:
        """The text of every kept line, unfinished ones last."""
        return [text for _, text in self.tail()]

    def __contains__(self, entry: object) -> bool:
        return entry in self.lines

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.tail())
