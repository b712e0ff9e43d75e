"""Remote tracebacks as IPython shows local ones: notebook cells named "Cell In[3], line 5"."""

from __future__ import annotations

import re
from typing import Any

_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def ipython_cell_names(shell: Any) -> Any:
    """A traceback rewriter naming the cells of this IPython shell (None if it cannot)."""
    label_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if label_of is None:
        return None

    def rewrite(text: str) -> str:
        def rename(match: re.Match[str]) -> str:
            label = label_of(match.group(1))
            return f"{label[0]} {label[1]}, line {match.group(2)}" if label else match.group(0)

        return _FILE_LINE.sub(rename, text)

    return rewrite
