"""ipywidgets front ends of the sharding and timing views (the notebook's process only).

Their content lives in the widget model, so a notebook saved with widget state shows
them again; a frontend without widgets shows the text view instead.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets


class _TextFallback:
    """Mixin: a frontend without widgets shows this text."""

    fallback_text = ""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}  # type: ignore[misc]
        bundle["text/plain"] = self.fallback_text
        return bundle


class ShardingWidget(_TextFallback, widgets.VBox):
    """A DTensor's layout; dropdowns pick the two tensor dims to draw (no round trip to ranks)."""

    def __init__(self, view: Any):
        from .shardview import ShardingView

        self.view = view
        self.picture = widgets.HTML(view.html())
        self.fallback_text = view.text()
        children: list[widgets.Widget] = []
        ndim = len(view.layout.global_shape) if isinstance(view, ShardingView) else 0
        if isinstance(view, ShardingView) and view.layout.is_dtensor and ndim >= 2:
            dims = [(f"dim {d} ({view.layout.global_shape[d]})", d) for d in range(ndim)]
            self.rows = widgets.Dropdown(options=dims, value=view.rows, description="rows")
            self.cols = widgets.Dropdown(options=dims, value=view.cols, description="cols")
            self.rows.observe(self._redraw, "value")
            self.cols.observe(self._redraw, "value")
            children.append(widgets.HBox([self.rows, self.cols]))
        super().__init__([*children, self.picture])

    def _redraw(self, _change: Any) -> None:
        from .shardview import ShardingView

        if self.rows.value == self.cols.value:
            return
        self.view = ShardingView(self.view.layout, self.rows.value, self.cols.value)
        self.picture.value = self.view.html()
        self.fallback_text = self.view.text()


class TimingWidget(_TextFallback, widgets.HTML):
    """Per-rank timing bars of one run."""

    def __init__(self, view: Any):
        self.fallback_text = view.text()
        super().__init__(view.html())


def show(view: Any, widget_class: type) -> None:
    """Display a view: a widget in a kernel, rich in a terminal, text otherwise."""
    from IPython import get_ipython
    from IPython.display import display

    shell = get_ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        display(widget_class(view))
    elif shell is not None and hasattr(view, "__rich__"):
        from rich.console import Console

        Console().print(view)
    else:
        display(view._repr_mimebundle_(), raw=True)
