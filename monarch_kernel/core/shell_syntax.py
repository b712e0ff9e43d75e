"""How IPython's shell syntax in a `%%mesh` cell reaches the ranks (notebook and rank agree on it).

The notebook's IPython rewrites `!cmd` and `%magic` lines into `get_ipython().system(...)`
and the like; `to_mesh_python` points those calls at `_mesh_shell`, the name under which
each rank keeps its RankShell (`rank/rankshell.py`).
"""

from __future__ import annotations

import re

MESH_SHELL = "_mesh_shell"  # the rank's RankShell, in the cells' namespace
_IPYTHON_CALL = re.compile(r"\bget_ipython\(\)\.(system|getoutput|run_line_magic|run_cell_magic)\(")


def to_mesh_python(python_from_ipython: str) -> str:
    """Point the `get_ipython()` calls that IPython's input transformer wrote at the rank shell."""
    return _IPYTHON_CALL.sub(MESH_SHELL + r".\1(", python_from_ipython)
