"""Plain-text tables: columns padded to their widest cell."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Each row as one line, columns left-aligned and two spaces apart (trailing spaces dropped)."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
