"""Compiling and running notebook cells on a rank, and readable tracebacks.

Cells are compiled under a name like `<mesh In[3]>` whose source is registered in
linecache, so tracebacks show the cell's own lines. As in IPython, a trailing
expression is evaluated separately and becomes the cell's value; top-level `await`
is allowed.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import linecache
from typing import Any

from monarch_kernel.core.source import compile_cell
from monarch_kernel.wire.describe import describe_failure

__all__ = ["CellRunner", "describe_failure", "register_source"]


def register_source(code: str, filename: str) -> None:
    """Make `filename`'s source visible to tracebacks (kept as it is if it holds this source)."""
    held = linecache.cache.get(filename)
    if held is None or held[0] != len(code) or "".join(held[2]) != code:
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)


class CellRunner:
    """Runs cells in one persistent namespace (the rank's `__main__`-like module)."""

    def __init__(self, namespace: dict[str, Any]):
        self.namespace = namespace
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, code: str, filename: str) -> Any:
        """Run a cell; return the value of its trailing expression (or None)."""
        register_source(code, filename)
        body, expr = compile_cell(code, filename)
        if body is not None:
            self._finish(eval(body, self.namespace))
        if expr is None:
            return None
        return self._finish(eval(expr, self.namespace))

    def evaluate(self, expr: str) -> Any:
        """Evaluate one expression in the namespace."""
        filename = "<mesh pull>"
        register_source(expr, filename)
        code = compile(expr, filename, "eval", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        return self._finish(eval(code, self.namespace))

    def _finish(self, value: Any) -> Any:
        if inspect.iscoroutine(value):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(value)
        return value
