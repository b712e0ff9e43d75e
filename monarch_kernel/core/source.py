"""How a cell's source is compiled: the same in the notebook (to check it before sending)
and on the ranks (to run it, with the value of a trailing expression)."""

from __future__ import annotations

import ast
import functools
from types import CodeType

_FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


def check_syntax(code: str, filename: str) -> None:
    """Raise SyntaxError (with the cell's line) before anything is sent to ranks."""
    _compiled(code, filename)


def _compiled(code: str, filename: str) -> tuple[CodeType | None, CodeType | None]:
    try:
        return _compile_source(code)
    except SyntaxError:
        ast.parse(code, filename, "exec")  # the same error, naming the cell
        raise


def compile_cell(code: str, filename: str) -> tuple[CodeType | None, CodeType | None]:
    """Split a cell into its body and a trailing expression (whose value is returned).

    As in IPython, a trailing semicolon means "no value". A source is compiled once (the
    same cell run again, or on every rank of a host, costs a rename, not a compile).
    """
    body, expr = _compiled(code, filename)
    return _renamed(body, filename), _renamed(expr, filename)


_ANONYMOUS = "<mesh cell>"


@functools.lru_cache(maxsize=256)
def _compile_source(code: str) -> tuple[CodeType | None, CodeType | None]:
    tree = ast.parse(code, _ANONYMOUS, "exec")
    last = None
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr) and not code.rstrip().endswith(";"):
        tree.body.pop()
        last = ast.Expression(final.value)
    body = compile(tree, _ANONYMOUS, "exec", flags=_FLAGS, dont_inherit=True) if tree.body else None
    expr = compile(last, _ANONYMOUS, "eval", flags=_FLAGS, dont_inherit=True) if last else None
    return body, expr


def _renamed(code: CodeType | None, filename: str) -> CodeType | None:
    """`code` (and the functions and classes it defines) as if compiled under `filename`."""
    if code is None or code.co_filename == filename:
        return code
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)
