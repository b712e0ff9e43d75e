"""Where a run's live output goes: the OutputSink protocol and the plain-text default.

The controller queues output events per request; the thread that waits for the result
pumps them into a sink. The IPython extension installs a richer default (live, deduped
cell output); without it, lines are printed with their rank.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from monarch_kernel.api.aggregated_output import AggregatedOutput
from monarch_kernel.core.timing import RankTiming, TimingReporter


class OutputSink(Protocol):
    """Receives a run's output events, in order, on one thread."""

    def output(self, rank: int, stream: str, text: str) -> None:
        """Text a rank printed."""

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """A rich display made on a rank."""

    def notice(self, rank: int, text: str) -> None:
        """News about a rank (it died, stopped answering...)."""

    def rank_done(self, rank: int) -> None:
        """A rank finished this run."""

    def tick(self) -> None:
        """Called regularly while waiting: a chance to refresh a live view."""

    def close(self) -> None:
        """The run is over: show everything that is left."""

    # Optional: `new_block()`, called before the notebook asks for input on the ranks'
    # behalf, so that text so far stays above the question and later text goes below;
    # `verdict(text, html)`, why the ranks make no progress (a hang seen while waiting),
    # updated while it lasts (without it, the verdict comes as a notice).


class PlainSink:
    """Prints each line as `[rank] text` to a stream, as it arrives."""

    def __init__(self, stream=None):
        self._stream = stream
        self._partial: dict[tuple[int, str], str] = {}

    @property
    def stream(self):
        """The stream written to (sys.stdout at the time of writing by default)."""
        return self._stream or sys.stdout

    def output(self, rank: int, stream: str, text: str) -> None:
        """Print each complete line as `[rank] text`."""
        key = (rank, stream)
        lines = (self._partial.pop(key, "") + text).split("\n")
        self._partial[key] = lines.pop()
        for line in lines:
            self.stream.write(f"[{rank}] {line}\n")

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Print the display's plain-text form."""
        self.stream.write(f"[{rank}] {data.get('text/plain', '<display>')}\n")

    def notice(self, rank: int, text: str) -> None:
        """Print the notice, marked with `!`."""
        self.stream.write(f"[{rank}] ! {text}\n")

    def rank_done(self, rank: int) -> None:
        """Print what is left of the rank's unfinished lines."""
        for stream in ("stdout", "stderr"):
            rest = self._partial.pop((rank, stream), "")
            if rest:
                self.stream.write(f"[{rank}] {rest}\n")

    def tick(self) -> None:
        """Nothing to refresh: lines are printed as they come."""

    def close(self) -> None:
        """Print every unfinished line."""
        for (rank, _), rest in sorted(self._partial.items()):
            if rest:
                self.stream.write(f"[{rank}] {rest}\n")
        self._partial.clear()
        self.stream.flush()


class IdleOutput:
    """Text ranks print outside any cell (actor endpoints, their threads), shown as it comes.

    Whole lines go to this process's stdout/stderr, tagged with the rank (`[rank 3] ...`; processes
    started through the Monarch API tag them as Monarch's do, `[host pid] [local rank] ...`, and
    `[local rank] ...` in groups of similar lines: see `tag_lines_with`); in a notebook they appear in
    the cell that is running (or the last one that ran). What a rank prints this way is bounded,
    since it is handled on the controller's loop that every mesh shares:
    a trailing partial line keeps its last PARTIAL_KEPT characters (a progress stream without
    newlines), and each rank may show IDLE_BUDGET characters per IDLE_WINDOW_S; the rest is
    dropped, and a note says how much.
    """

    PARTIAL_KEPT = 64 << 10
    IDLE_BUDGET = 4 << 20
    IDLE_WINDOW_S = 10.0

    def __init__(self, clock: Callable[[], float] = time.monotonic, label: str = "") -> None:
        self._partial: dict[tuple[int, str], list[str]] = {}
        self._partial_len: dict[tuple[int, str], int] = {}
        self._window: dict[int, tuple[float, int, int]] = {}  # rank -> (window start, shown, dropped)
        self._clock = clock
        self._label = label  # how an aggregated window names the mesh ("mesh 'train'")
        self.shown = True  # False: lines are kept in the ranks' logs (%mesh logs) only
        self._aggregated: AggregatedOutput | None = None
        self._tag: Callable[[int], str] = lambda rank: f"[rank {rank}]"
        self._tag_in_groups: Callable[[int], str] = self._tag

    def tag_lines_with(self, tag: Callable[[int], str], in_groups: Callable[[int], str] | None = None) -> None:
        """How a rank's lines are tagged from now on: `tag(rank)`, and `in_groups(rank)` in windows of similar
        lines (default: the same); called on the controller's loop."""
        self._tag = tag
        self._tag_in_groups = in_groups or tag

    def set_mode(self, shown: bool, aggregate_window_s: float | None) -> None:
        """Show these lines or not, and one by one (None) or in windows of similar lines (`api/aggregated_output.py`).
        Lines waiting in a window are shown first when aggregation ends or the lines stop being shown."""
        aggregated = self._aggregated
        if aggregated is not None and (aggregate_window_s is None or not shown):
            self._aggregated = None
            aggregated.flush()
        elif aggregated is not None and aggregate_window_s is not None:
            aggregated.set_window(aggregate_window_s)
        elif aggregate_window_s is not None and shown:
            self._aggregated = AggregatedOutput(self._label, aggregate_window_s)
        self.shown = shown

    def flush(self) -> None:
        """Show the lines waiting in a window now (the mesh stops, the kernel exits)."""
        if self._aggregated is not None:
            self._aggregated.flush()

    def write(self, rank: int, stream: str, text: str) -> None:
        """Show the complete lines of `text`; keep a trailing partial line for later."""
        key = (rank, stream)
        kept = self._within_budget(rank, text)
        if len(kept) < len(text) and "\n" in text[len(kept):]:  # a line ended in what was dropped
            self._partial.pop(key, None)
            self._partial_len.pop(key, None)
        text = kept
        if not text:
            return
        if "\n" not in text:  # no line ends yet: keep the pieces (joined only when they are too long)
            pieces = self._partial.setdefault(key, [])
            pieces.append(text)
            size = self._partial_len.get(key, 0) + len(text)
            if size > self.PARTIAL_KEPT:
                kept = "".join(pieces)[-self.PARTIAL_KEPT:]
                pieces[:] = [kept]
                size = len(kept)
            self._partial_len[key] = size
            return
        text = "".join(self._partial.pop(key, ())) + text
        self._partial_len.pop(key, None)
        *lines, rest = text.split("\n")
        if rest:
            self._partial[key] = [rest[-self.PARTIAL_KEPT:]]
            self._partial_len[key] = len(self._partial[key][0])
        if not lines or not self.shown:
            return
        aggregated = self._aggregated
        if aggregated is not None:
            tag = self._tag_in_groups(rank)
            for line in lines:
                aggregated.add(stream, f"{tag} {line}")
            return
        tag = self._tag(rank)
        out = sys.stderr if stream == "stderr" else sys.stdout
        out.write("".join(f"{tag} {line[-self.PARTIAL_KEPT:]}\n" for line in lines))
        out.flush()

    def _within_budget(self, rank: int, text: str) -> str:
        now = self._clock()
        start, shown, dropped = self._window.get(rank, (now, 0, 0))
        if now - start >= self.IDLE_WINDOW_S:
            if dropped:
                sys.stderr.write(f"{self._tag(rank)} [monarch_kernel: {dropped:,} characters printed outside any cell "
                                 f"were dropped; at most {self.IDLE_BUDGET:,} are shown per "
                                 f"{self.IDLE_WINDOW_S:g} s]\n")
                sys.stderr.flush()
            start, shown, dropped = now, 0, 0
        room = max(0, self.IDLE_BUDGET - shown)
        if len(text) > room:
            if not dropped:
                sys.stderr.write(f"{self._tag(rank)} [monarch_kernel: over {self.IDLE_BUDGET:,} characters printed outside "
                                 f"any cell in {self.IDLE_WINDOW_S:g} s: the rest is dropped until then]\n")
            dropped += len(text) - room
            text = text[:room]
        self._window[rank] = (start, shown + len(text), dropped)
        return text


SinkFactory = Callable[[dict[str, Any]], OutputSink]
_default_factory: SinkFactory = lambda options: PlainSink()  # noqa: E731


def set_default_sink_factory(factory: SinkFactory | None) -> None:
    """Install the sink used when a run is not given one (None restores plain text)."""
    global _default_factory
    _default_factory = factory or (lambda options: PlainSink())


def default_sink(**options: Any) -> OutputSink:
    """A new sink from the installed factory; options: ranks, dedupe, label..."""
    return _default_factory(options)


_timing_reporter: list[TimingReporter] = []


def set_timing_reporter(reporter: TimingReporter | None) -> None:
    """Where per-rank timings of actor calls are shown (the notebook sets one)."""
    _timing_reporter[:] = [reporter] if reporter is not None else []


def report_timing(label: str, times: list[RankTiming]) -> None:
    """Show how long each rank took for a call, if someone shows such things."""
    for reporter in _timing_reporter:
        reporter(label, times)
