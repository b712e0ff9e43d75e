"""Compiling and running notebook cells on a rank, and readable tracebacks.

Cells are compiled under a name like `<mesh In[3]>` whose source is registered in
linecache, so tracebacks show the cell's own lines. As in IPython, a trailing
expression is evaluated separately and becomes the cell's value; top-level `await`
is allowed.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import linecache
import os
import traceback
from types import CodeType
from typing import Any

from .messages import Failure

_FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def check_syntax(code: str, filename: str) -> None:
    """Raise SyntaxError (with the cell's line) before anything is sent to ranks."""
    compile_cell(code, filename)


def register_source(code: str, filename: str) -> None:
    """Make `filename`'s source visible to tracebacks."""
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)


def compile_cell(code: str, filename: str) -> tuple[CodeType | None, CodeType | None]:
    """Split a cell into its body and a trailing expression (whose value is returned).

    As in IPython, a trailing semicolon means "no value". A source is compiled once (the
    same cell run again, or on every rank of a host, costs a rename, not a compile).
    """
    try:
        body, expr = _compile_source(code)
    except SyntaxError:
        ast.parse(code, filename, "exec")  # the same error, naming the cell
        raise
    return _renamed(body, filename), _renamed(expr, filename)


_ANONYMOUS = "<mesh cell>"


@functools.lru_cache(maxsize=256)
def _compile_source(code: str) -> tuple[CodeType | None, CodeType | None]:
    tree = ast.parse(code, _ANONYMOUS, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, _ANONYMOUS, "exec", flags=_FLAGS, dont_inherit=True) if tree.body else None
    expr = compile(last, _ANONYMOUS, "eval", flags=_FLAGS, dont_inherit=True) if last else None
    return body, expr


def _renamed(code: CodeType | None, filename: str) -> CodeType | None:
    """`code` (and the functions and classes it defines) as if compiled under `filename`."""
    if code is None or code.co_filename == filename:
        return code
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


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
        code = compile(expr, filename, "eval", flags=_FLAGS, dont_inherit=True)
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


def _drop_own_frames(te: traceback.TracebackException) -> None:
    """Remove monarch_kernel's own frames (dispatch, signal handler) from a traceback."""
    seen: set[int] = set()
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not f.filename.startswith(_PACKAGE_DIR)])
        te = te.__cause__ or te.__context__
