"""Live, deduplicated output of a run in the notebook cell (or terminal) that started it.

In a Jupyter kernel, the cell's text lives in one display that is updated in place (at
most every REFRESH_S, and at once for the first line; a long output is redrawn less often,
so a training loop that logs every step sends at most about MAX_BYTES_PER_S). While the
cell waits, updates go as display messages addressed to the cell's own request. A
background run (`--bg`) outlives its cell's request, so its output goes into an
ipywidgets Output widget shown in that cell: widget updates travel over the widget's
comm, which frontends route by widget, not by request, so the text keeps landing in the
right cell. In a terminal, lines are printed once they are settled (no rank can still
join them).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from monarch_kernel.views.output import OutputGroups, render_html, render_text

REFRESH_S = 0.05
MAX_BYTES_PER_S = 1_000_000  # a long output is redrawn less often: at most ~1 MB/s to the frontend


class KernelPublisher:
    """Sends display/update messages to the cell whose request was current at creation."""

    def __init__(self, shell: Any):
        self._shell = shell
        kernel = getattr(shell, "kernel", None)
        self._parent = kernel.get_parent() if kernel is not None and hasattr(kernel, "get_parent") else None

    def _with_parent(self, fn, *args, **kwargs) -> None:
        pub = self._shell.display_pub
        setter = getattr(pub, "set_thread_parent", None)
        token = setter(self._parent) if setter is not None and self._parent else None
        try:
            fn(*args, **kwargs)
        finally:
            if token is not None:
                pub.reset_thread_parent(token)

    def show(self, bundle: dict[str, Any], metadata: dict[str, Any] | None = None, *, live: bool = True) -> str:
        """Display a bundle; returns its display id (for updates)."""
        from IPython.display import display

        display_id = uuid.uuid4().hex
        self._with_parent(display, bundle, raw=True, metadata=metadata or {},
                          display_id=display_id if live else None)
        return display_id

    def update(self, display_id: str, bundle: dict[str, Any]) -> None:
        """Replace the content of a display shown earlier."""
        from IPython.display import update_display

        self._with_parent(update_display, bundle, raw=True, display_id=display_id)


class WidgetPublisher:
    """Shows a run's outputs inside one ipywidgets Output, displayed in the current cell."""

    def __init__(self) -> None:
        import ipywidgets
        from IPython.display import display

        self.widget = ipywidgets.Output()
        display(self.widget)  # now, while the starting cell is still the current request
        self._ids: list[str] = []

    def show(self, bundle: dict[str, Any], metadata: dict[str, Any] | None = None, *, live: bool = True) -> str:
        """Append an output; returns its id (for updates)."""
        display_id = uuid.uuid4().hex
        self._ids.append(display_id)
        self.widget.outputs = (*self.widget.outputs, _display_output(bundle, metadata))
        return display_id

    def update(self, display_id: str, bundle: dict[str, Any]) -> None:
        """Replace an output shown earlier."""
        index = self._ids.index(display_id)
        outputs = list(self.widget.outputs)
        outputs[index] = _display_output(bundle, None)
        self.widget.outputs = tuple(outputs)


def _display_output(bundle: dict[str, Any], metadata: dict[str, Any] | None) -> dict[str, Any]:
    return {"output_type": "display_data", "data": bundle, "metadata": metadata or {}}


class LiveOutput:
    """An OutputSink that shows grouped rank output live in a Jupyter cell."""

    def __init__(self, ranks: tuple[int, ...], *, dedupe: bool, publisher: KernelPublisher | WidgetPublisher,
                 announcement: str | None = None):
        self._ranks = ranks
        self._dedupe = dedupe
        self._publisher = publisher
        self._model = OutputGroups(ranks, dedupe=dedupe)
        self._display_id: str | None = None
        self._shown_version = 0
        self._last_render = 0.0
        self._interval = REFRESH_S
        self._verdict_id: str | None = None  # the block that says why the ranks make no progress
        if announcement is not None:  # claim the spot in the cell now, while it still runs
            self._display_id = publisher.show({"text/plain": announcement})
            self._shown_version = -1

    def output(self, rank: int, stream: str, text: str) -> None:
        """Text a rank printed."""
        self._model.add(rank, stream, text)
        self._maybe_render()

    def notice(self, rank: int, text: str) -> None:
        """News about a rank (it died, stopped answering...)."""
        self._model.notice(rank, text)
        self._render()

    def rank_done(self, rank: int) -> None:
        """A rank finished this run."""
        self._model.finish_rank(rank)
        self._maybe_render()

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """A rich display made on a rank."""
        self.new_block()
        self._publisher.show(label_bundle(rank, data), metadata, live=False)

    def verdict(self, text: str, html: str) -> None:
        """Why the ranks make no progress: one block of its own, updated in place while the hang lasts."""
        bundle = {"text/plain": text, "text/html": html}
        if self._verdict_id is None:
            self._verdict_id = self._publisher.show(bundle)
        else:
            self._publisher.update(self._verdict_id, bundle)

    def new_block(self) -> None:
        """Freeze the text so far; what comes next goes below whatever is shown now (a display, a prompt)."""
        self._model.finish()
        self._render()
        self._model = OutputGroups(self._ranks, dedupe=self._dedupe)
        self._display_id = None
        self._shown_version = 0

    def tick(self) -> None:
        """Refresh the live view if it is due."""
        self._maybe_render()

    def close(self) -> None:
        """The run is over: show everything that is left."""
        self._model.finish()
        self._render()

    def _maybe_render(self) -> None:
        if self._model.version == self._shown_version:
            return
        if self._display_id is None or time.monotonic() - self._last_render >= self._interval:
            self._render()

    def _render(self) -> None:
        if self._model.version == self._shown_version:
            return
        bundle = {"text/plain": render_text(self._model), "text/html": render_html(self._model)}
        self._interval = max(REFRESH_S, (len(bundle["text/plain"]) + len(bundle["text/html"])) / MAX_BYTES_PER_S)
        if self._display_id is None:
            self._display_id = self._publisher.show(bundle)
        else:
            self._publisher.update(self._display_id, bundle)
        self._shown_version = self._model.version
        self._last_render = time.monotonic()


class TerminalOutput:
    """An OutputSink for terminal IPython: prints settled groups, never rewrites."""

    def __init__(self, ranks: tuple[int, ...], *, dedupe: bool, stream=None):
        import sys

        self._model = OutputGroups(ranks, dedupe=dedupe)
        self._printed = 0
        self._stream = stream or sys.stdout

    def _emit(self, upto: int) -> None:
        if upto > self._printed:
            self._stream.write(render_text(self._model, self._printed, upto, tail=False) + "\n")
            self._printed = upto

    def output(self, rank: int, stream: str, text: str) -> None:
        """Text a rank printed."""
        self._model.add(rank, stream, text)
        self._emit(self._model.settled())

    def notice(self, rank: int, text: str) -> None:
        """News about a rank (it died, stopped answering...)."""
        self._model.notice(rank, text)
        self._emit(self._model.settled())

    def rank_done(self, rank: int) -> None:
        """A rank finished this run."""
        self._model.finish_rank(rank)
        self._emit(self._model.settled())

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """A rich display made on a rank."""
        self._stream.write(f"[rank {rank}] {data.get('text/plain', '<display>')}\n")

    def verdict(self, text: str, html: str) -> None:
        """Why the ranks make no progress (printed each time it changes)."""
        self._stream.write(text + "\n")
        self._stream.flush()

    def new_block(self) -> None:
        """Print everything so far (a prompt follows)."""
        self._model.finish(realign=False)
        self._emit(len(self._model.groups))
        self._stream.flush()
        self._model = OutputGroups(self._model.all_ranks, dedupe=self._model.dedupe)
        self._printed = 0

    def tick(self) -> None:
        """Refresh the live view if it is due."""
        pass

    def close(self) -> None:
        """The run is over: show everything that is left."""
        self._model.finish(realign=False)  # lines already printed cannot move
        self._emit(len(self._model.groups))
        note = render_text(self._model, len(self._model.groups))
        if note:
            self._stream.write(note + "\n")
        self._stream.flush()


def label_bundle(rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """A rank's display bundle, labelled with the rank in text and HTML."""
    out = dict(data)
    out["text/plain"] = f"[rank {rank}] {data.get('text/plain', '')}"
    inner = data.get("text/html")
    if inner is None and "image/png" in data:
        inner = f"<img src='data:image/png;base64,{data['image/png']}'/>"
    if inner is None and "image/svg+xml" in data:
        inner = data["image/svg+xml"]
    if inner is not None:
        out["text/html"] = (f"<div class='monarch-rank-display'><div style='font-size:smaller;opacity:.6'>"
                            f"rank {rank}</div>{inner}</div>")
    return out
