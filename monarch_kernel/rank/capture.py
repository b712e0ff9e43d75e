"""What a rank prints and displays, captured and streamed to the controller.

`RankStream` replaces sys.stdout / sys.stderr on a rank. Writes are buffered and a
flusher thread sends them every few milliseconds, so live output costs one message per
burst, not per line. `flush()` is called before each reply, so output always arrives
before the result it belongs to. Output per request is capped; the rest is counted and
reported as dropped. Progress bars (`\\r` rewrites of a line) send only their latest state
per burst and do not count against the cap, so a long training loop keeps its bar.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.util
import io
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.termtext import compact, progress_chars
from monarch_kernel.rank.debugging import untraced
from monarch_kernel.wire.messages import Display, Output

FLUSH_DELAY_S = 0.003
MAX_OUTPUT_PER_REQUEST = 8 << 20  # characters of text per rank per request (and per window outside requests)
IDLE_WINDOW_S = 10.0  # the budget of output outside any request is refilled this often


class RankStream(io.TextIOBase):
    """A text stream that forwards to the controller, tagged with the current request.

    `write` only appends to a list (atomic under the GIL) and wakes the flusher once
    per burst, so a print costs about as much as on a local stream; the per-request
    cap is applied when the flusher takes the text.
    """

    def __init__(self, name: str, rank: int, send: Callable[[Any], None]):
        self.name = name
        self.request_id: int | None = None  # set by the worker around each request
        self.outside_requests: set[int] = set()  # threads whose output belongs to no request (actors' own)
        self._rank = rank
        self._send = send
        self._chunks: list[tuple[int | None, str]] = []
        self._send_lock = threading.Lock()  # held from taking chunks until they are sent
        self._wake = threading.Event()
        self._wake_pending = False  # a wake-up is already on its way to the flusher
        self._sent_by_request: dict[int | None, int] = {}
        self._dropped: dict[int | None, int] = {}
        self._idle_since = time.monotonic()
        untraced(threading.Thread(target=self._flush_loop, name=f"rank-{name}-flusher", daemon=True)).start()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # fixed, where TextIOBase lets it be set
        """The text encoding (UTF-8)."""
        return "utf-8"

    def writable(self) -> bool:
        """Always True."""
        return True

    def isatty(self) -> bool:
        """Never a terminal."""
        return False

    def write(self, text: str) -> int:
        """Queue text for sending; returns its length like a real stream."""
        if text.__class__ is not str and not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            req = self.request_id
            if req is not None and self.outside_requests and threading.get_ident() in self.outside_requests:
                req = None
            self._chunks.append((req, text))
            if not self._wake_pending:
                self._wake_pending = True
                self._wake.set()
        return len(text)

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            threading.Event().wait(FLUSH_DELAY_S)  # let a burst of writes coalesce
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - connection gone: the rank is exiting anyway
                return

    def flush(self) -> None:
        """Send everything written so far (in order, one message per request run)."""
        with self._send_lock:
            self._wake_pending = False
            chunks, self._chunks = self._chunks, []
            for req, text in _merge(chunks):
                text = self._within_cap(req, compact(text))
                if text:
                    self._send(Output(self._rank, req, self.name, text))

    def _within_cap(self, req: int | None, text: str) -> str:
        """Text up to the request's cap; progress-bar rewrites (they replace a line) are free.

        Output outside any request (req None: actor endpoints, threads) has a budget that is
        refilled every IDLE_WINDOW_S, after a note of what the last window dropped.
        """
        if req is None:
            self._roll_idle_window()
        sent = self._sent_by_request.get(req, 0)
        room = max(0, MAX_OUTPUT_PER_REQUEST - sent)
        cost = len(text) - progress_chars(text) if "\r" in text else len(text)
        if cost > room:
            self._dropped[req] = self._dropped.get(req, 0) + len(text) - room
            text = text[:room]
            cost = room
        self._sent_by_request[req] = sent + cost
        return text

    def _roll_idle_window(self) -> None:
        now = time.monotonic()
        if now - self._idle_since < IDLE_WINDOW_S:
            return
        self._idle_since = now
        self._sent_by_request.pop(None, None)
        dropped = self._dropped.pop(None, 0)
        if dropped:
            self._send(Output(self._rank, None, "stderr",
                              f"\n[monarch_kernel: {dropped:,} characters of {self.name} printed outside any cell on "
                              f"this rank were dropped; at most {MAX_OUTPUT_PER_REQUEST:,} are kept per "
                              f"{IDLE_WINDOW_S:g} s]\n"))

    def finish_request(self, req: int | None) -> None:
        """Flush, then report how much of this request's output was dropped, if any."""
        with self._send_lock:  # (taken even when nothing is queued: a flush under way finishes first)
            if not self._chunks and req not in self._dropped:
                self._sent_by_request.pop(req, None)
                return
        self.flush()
        with self._send_lock:
            dropped = self._dropped.pop(req, 0)
            self._sent_by_request.pop(req, None)
        if dropped:
            note = (f"\n[monarch_kernel: {dropped:,} more characters of {self.name} from this rank "
                    f"were dropped; at most {MAX_OUTPUT_PER_REQUEST:,} are kept per cell]\n")
            self._send(Output(self._rank, req, "stderr", note))


def _merge(chunks: list[tuple[int | None, str]]) -> list[tuple[int | None, str]]:
    """Join consecutive chunks of the same request (one join per run, not per chunk)."""
    runs: list[tuple[int | None, list[str]]] = []
    for req, text in chunks:
        if runs and runs[-1][0] == req:
            runs[-1][1].append(text)
        else:
            runs.append((req, [text]))
    return [(req, "".join(parts)) for req, parts in runs]


def mime_bundle(obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MIME bundle IPython would show for obj, built without importing IPython."""
    if hasattr(obj, "_repr_mimebundle_"):
        try:
            got = obj._repr_mimebundle_()
        except TypeError:
            got = obj._repr_mimebundle_(include=None, exclude=None)
        if got:
            bundle, meta = got if isinstance(got, tuple) else (got, {})
            bundle = dict(bundle)
            bundle.setdefault("text/plain", repr(obj))
            return bundle, dict(meta or {})
    data: dict[str, Any] = {"text/plain": repr(obj)}
    for mime, method in _REPR_METHODS:
        fn = getattr(obj, method, None)
        if fn is None:
            continue
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - a renderer that fails is skipped
            continue
        if value is None:
            continue
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        data[mime] = value
    if _is_matplotlib_figure(obj):
        data["image/png"] = figure_png(obj)
    return data, {}


_REPR_METHODS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
]


def _is_matplotlib_figure(obj: Any) -> bool:
    figure_mod = sys.modules.get("matplotlib.figure")
    return figure_mod is not None and isinstance(obj, figure_mod.Figure)


def figure_png(fig: Any) -> str:
    """A matplotlib figure as base64 PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


class DisplayCapture:
    """`display()` for ranks: sends MIME bundles to the controller, tagged by request."""

    def __init__(self, rank: int, send: Callable[[Any], None], request: Callable[[], int | None],
                 before_send: Callable[[], None]):
        self._rank = rank
        self._send = send
        self._request = request
        self._before_send = before_send
        self._hooked = False

    def display(self, *objs: Any, raw: bool = False, metadata: dict | None = None, **_: Any) -> None:
        """Show objects in the notebook cell that is running on this rank."""
        self._before_send()  # keep prints and displays in order
        for obj in objs:
            if raw and isinstance(obj, dict):
                data, meta = obj, dict(metadata or {})
            else:
                data, meta = mime_bundle(obj)
            self._send(Display(self._rank, self._request(), data, meta))

    def flush_figures(self) -> None:
        """Send and close open matplotlib figures, as the inline backend does."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            self._send(Display(self._rank, self._request(),
                               {"image/png": figure_png(fig), "text/plain": repr(fig)}, {}))
        plt.close("all")

    def patch_ipython(self) -> None:
        """Route IPython's display() here, now and whenever IPython is imported later."""
        module = sys.modules.get(_IPYTHON_DISPLAY)
        if module is not None:
            module.display = self.display  # type: ignore[attr-defined]
        elif not self._hooked:
            self._hooked = True
            sys.meta_path.insert(0, _PatchOnImport(self.display))


_IPYTHON_DISPLAY = "IPython.core.display_functions"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Replaces IPython's display() as soon as its module is loaded on the rank."""

    def __init__(self, display: Callable[..., None]):
        self._display = display

    def find_spec(self, name, path, target=None):
        """Hook the import of display libraries (matplotlib) when it happens."""
        if name != _IPYTHON_DISPLAY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module
        display = self._display

        def exec_module(module):
            original(module)
            module.display = display

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
