"""Text of remote failures: one block per distinct error, naming the ranks that hit it."""

from __future__ import annotations

import re
import sys

from .errors import RankFailure
from .shape import format_ranks

_RED, _BOLD, _DIM, _RESET = "\x1b[31m", "\x1b[1m", "\x1b[2m", "\x1b[0m"


def group_failures(failures: list[RankFailure]) -> list[tuple[list[int], RankFailure]]:
    """Group identical failures (same error and traceback) in first-rank order."""
    groups: dict[tuple, tuple[list[int], RankFailure]] = {}
    for f in sorted(failures, key=lambda f: f.rank):
        key = f.signature()
        if key in groups:
            groups[key][0].append(f.rank)
        else:
            groups[key] = ([f.rank], f)
    return list(groups.values())


def format_failures(failures: list[RankFailure], *, color: bool) -> str:
    """Readable text for a list of rank failures."""
    red, bold, dim, reset = (_RED, _BOLD, _DIM, _RESET) if color else ("", "", "", "")
    blocks = []
    for ranks, f in group_failures(failures):
        hosts = sorted({x.host for x in failures if x.rank in ranks})
        where = f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} (host {', '.join(hosts)})"
        if f.kind == "died":
            lines = [f"{red}{bold}[{where}] rank died{reset}: {f.message}"]
            if f.stderr_tail:
                lines.append(f"{dim}  last stderr lines:{reset}")
                lines.extend(f"{dim}    {line}{reset}" for line in f.stderr_tail)
        elif f.traceback:
            lines = [f"{red}{bold}[{where}] remote traceback:{reset}"]
            body = _cell_names(f.traceback).rstrip("\n").splitlines()
            lines.extend(f"  {line}" for line in body[:-1])
            lines.append(f"  {red}{body[-1]}{reset}" if body else "")
        else:
            lines = [f"{red}{bold}[{where}] {f.error_type}{reset}: {f.message}"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def _cell_names(text: str) -> str:
    """Name notebook cells as IPython does ("Cell In[3], line 5"), not by their temp file."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    label_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if label_of is None:
        return text

    def rename(match: re.Match) -> str:
        label = label_of(match.group(1))
        return f"{label[0]} {label[1]}, line {match.group(2)}" if label else match.group(0)

    return _FILE_LINE.sub(rename, text)
