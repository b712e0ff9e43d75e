"""Lines ranks print outside any cell, gathered for a time window and shown as groups of similar lines.

`ProcMesh.logging_option(stream_to_client=True, aggregate_window_sec=N)` (Monarch's call) turns it on for
a mesh: instead of one line per rank per print (a training loop's "step 812 loss 2.31" from 64 ranks),
the notebook shows, every N seconds, each group of similar lines once with how many there were:

    [mesh 'train' 12:00:01-12:00:04: 128 lines]
    [64 similar log lines] [rank 0] step 812 loss 2.31
    [64 similar log lines] [rank 3] step 813 loss 2.29

Two lines are similar when few characters differ: their edit distance is under 15% of the longer one's
length (Monarch's rule), so lines that differ in a rank, a step or a number fall in one group, shown as
its first line. A window opens with its first line and is shown when it closes, when the window is
changed or aggregation turned off, when the mesh stops and when the kernel exits.

Threads: `add` on the controller's loop, `flush` on any thread (a timer's, the caller of
`logging_option`'s); `_lock` guards the groups and the timer, never held while writing.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

SIMILAR_BELOW = 0.15  # lines whose edit distance is under this share of the longer's length are one group
LINE_KEPT = 4096  # a longer line is cut here (and said so) before it is compared or kept


def similar(left: str, right: str, threshold: float = SIMILAR_BELOW) -> bool:
    """Whether the edit distance of `left` and `right` is under `threshold` of the longer one's length."""
    if left == right:
        return True
    longest = max(len(left), len(right))
    limit = threshold * longest  # distances must stay strictly under this
    if abs(len(left) - len(right)) >= limit:
        return False
    return _distance_within(left, right, math.ceil(limit) - 1) is not None


def _distance_within(left: str, right: str, most: int) -> int | None:
    """The edit distance of the two strings if it is at most `most`, else None (only a band of width
    2 * most + 1 around the diagonal is computed: lines of a few KiB stay cheap)."""
    if len(left) < len(right):
        left, right = right, left
    far = most + 1
    previous = [j if j <= most else far for j in range(len(right) + 1)]
    for i in range(1, len(left) + 1):
        low, high = max(1, i - most), min(len(right), i + most)
        current = [far] * (len(right) + 1)
        current[0] = i if i <= most else far
        best = current[0]
        char = left[i - 1]
        for j in range(low, high + 1):
            cost = previous[j - 1] + (char != right[j - 1])
            value = min(cost, previous[j] + 1, current[j - 1] + 1)
            current[j] = value if value <= most else far
            best = min(best, current[j])
        if best > most:
            return None
        previous = current
    return previous[len(right)] if previous[len(right)] <= most else None


@dataclass
class _Group:
    line: str
    count: int = 1


@dataclass
class _Window:
    opened: float = field(default_factory=time.time)
    groups: dict[str, list[_Group]] = field(default_factory=dict)  # stream -> its groups, in order of first line
    lines: int = 0


class AggregatedOutput:
    """The window of one mesh's lines (see the module's note); `window_s` may change while lines wait."""

    def __init__(self, label: str, window_s: float, streams: Callable[[str], TextIO] | None = None) -> None:
        self._label = label
        self._window_s = window_s
        self._streams = streams or (lambda stream: sys.stderr if stream == "stderr" else sys.stdout)
        self._lock = threading.Lock()
        self._window: _Window | None = None
        self._timer: threading.Timer | None = None

    def add(self, stream: str, line: str) -> None:
        """One line a rank printed (its rank already in it) on `stream` ("stdout" or "stderr")."""
        if len(line) > LINE_KEPT:
            line = line[:LINE_KEPT] + " ... [cut]"
        with self._lock:
            if self._window is None:
                self._window = _Window()
                self._schedule(self._window_s)
            window = self._window
            window.lines += 1
            groups = window.groups.setdefault(stream, [])
            for group in groups:
                if similar(group.line, line):
                    group.count += 1
                    return
            groups.append(_Group(line))

    def set_window(self, window_s: float) -> None:
        """A new window length; lines waiting now are shown once it has passed since their window opened."""
        with self._lock:
            self._window_s = window_s
            if self._window is not None:
                self._schedule(max(0.0, self._window.opened + window_s - time.time()))

    def flush(self) -> None:
        """Show the lines waiting now (nothing if none)."""
        with self._lock:
            window, self._window = self._window, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if window is None:
            return
        span = f"{time.strftime('%H:%M:%S', time.localtime(window.opened))}-{time.strftime('%H:%M:%S')}"
        for stream, groups in window.groups.items():
            out = self._streams(stream)
            lines = sum(group.count for group in groups)
            out.write(f"[{self._label} {span}: {lines} line{'s' if lines != 1 else ''}]\n" +
                      "".join(f"[{group.count} similar log lines] {group.line}\n" for group in groups))
            out.flush()

    def _schedule(self, after_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(after_s, self.flush)
        self._timer.daemon = True
        self._timer.name = "aggregated-output"
        self._timer.start()
