"""How a cell's source is compiled: the same in the notebook (to check it before sending)
and on the ranks (to run it, with the value of a trailing expression)."""

from __future__ import annotations

import ast
import functools
import itertools
import threading
from collections import OrderedDict
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


@functools.lru_cache(maxsize=64)
def compile_cell(code: str, filename: str) -> tuple[CodeType | None, CodeType | None]:
    """Split a cell into its body and a trailing expression (whose value is returned).

    As in IPython, a trailing semicolon means "no value". A source is compiled once (a new
    name for it, as each notebook cell gets, costs a rename, not a compile), and the same
    source under the same name again (a loop of `mesh.run(code)`, see CellNames) costs nothing.
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


class CellNames:
    """Names for code run without one (`mesh.run(code)`): `cell N`, the same N for the same code.

    So a loop that runs the same code again and again compiles it once on each rank and adds
    one source to tracebacks' line cache, not one per run; different code gets a new number.
    The last `keep` sources are remembered.
    """

    def __init__(self, keep: int = 256) -> None:
        self._numbers: OrderedDict[str, int] = OrderedDict()
        self._next = itertools.count(1)
        self._keep = keep
        self._lock = threading.Lock()

    def name_of(self, code: str) -> str:
        """`cell N` for this code."""
        with self._lock:
            number = self._numbers.pop(code, None)
            if number is None:
                number = next(self._next)
                while len(self._numbers) >= self._keep:
                    self._numbers.popitem(last=False)
            self._numbers[code] = number
        return f"cell {number}"
