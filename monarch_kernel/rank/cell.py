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
import traceback
from typing import Any

from monarch_kernel.core.package import PACKAGE_DIR
from monarch_kernel.core.source import compile_cell
from monarch_kernel.wire.messages import Failure


def register_source(code: str, filename: str) -> None:
    """Make `filename`'s source visible to tracebacks."""
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


def describe_failure(exc: BaseException) -> Failure:
    """Format an exception raised by user code, without our own frames."""
    if isinstance(exc, SystemExit):
        return Failure(
            "SystemExit",
            f"the cell called sys.exit({exc.code!r}); the rank keeps running",
            "",
        )
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    _drop_own_frames(te)
    lines = list(te.format())
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return Failure(
        type(exc).__name__,
        message,
        "".join(lines),
        interrupted=isinstance(exc, KeyboardInterrupt),
    )


def _drop_own_frames(first: traceback.TracebackException) -> None:
    """Remove monarch_kernel's own frames (dispatch, signal handler) from a traceback."""
    seen: set[int] = set()
    te: traceback.TracebackException | None = first
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not f.filename.startswith(PACKAGE_DIR)])
        te = te.__cause__ or te.__context__
