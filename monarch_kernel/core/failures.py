"""What went wrong on a rank (RankFailure), and its text: one block per distinct error."""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from monarch_kernel.core.ranksets import format_ranks

_RED, _BOLD, _DIM, _RESET = "\x1b[31m", "\x1b[1m", "\x1b[2m", "\x1b[0m"


class FailureKind(enum.StrEnum):
    """How work on a rank failed."""

    EXCEPTION = "exception"  # the code raised
    DIED = "died"  # the rank process exited or its host was lost
    INTERRUPTED = "interrupted"  # stopped by an interrupt, a timeout or a cancel
    LOST = "lost"  # the mesh restarted or shut down under it


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: an exception traceback, or the rank died."""

    rank: int
    host: str
    kind: FailureKind
    error_type: str
    message: str
    traceback: str = ""
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    stderr_tail: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind(self.kind))

    def signature(self) -> tuple[str, str, str]:
        """Key used to group identical failures from several ranks."""
        if self.kind == FailureKind.DIED:
            return (self.kind.value, f"rank {self.rank}", "")
        return (self.kind.value, self.error_type, self.traceback or self.message)


def exit_text(exit_code: int | None, signal: str | None) -> str:
    """How a process ended: "killed by SIGKILL" or "exit code 3"."""
    return f"killed by {signal}" if signal else f"exit code {exit_code}"


def process_status_in_monarchs_words(text: str) -> str | None:
    """What Monarch says of an actor whose process ended, from a death's text that has `exit_text` in it:
    "the process this actor was running on failed: Killed(sig=9)" (or "... exited with non-zero code 3")."""
    killed = re.search(r"killed by (SIG[A-Z0-9]+)", text)
    if killed and killed.group(1) in signal.Signals.__members__:
        return f"the process this actor was running on failed: Killed(sig={signal.Signals[killed.group(1)].value})"
    exited = re.search(r"exit code (-?[0-9]+)", text)
    if exited and exited.group(1) != "0":
        return f"the process this actor was running on exited with non-zero code {exited.group(1)}"
    return None


# Rewrites file names in remote tracebacks (the IPython extension names notebook cells).
_traceback_rewriters: list[Callable[[str], str]] = []


def set_traceback_rewriter(rewrite: Callable[[str], str] | None) -> None:
    """Install (or remove, with None) a function applied to remote tracebacks before showing them."""
    _traceback_rewriters[:] = [rewrite] if rewrite is not None else []


def group_failures(failures: list[RankFailure]) -> list[tuple[list[int], RankFailure]]:
    """Group identical failures (same error and traceback) in first-rank order."""
    groups: dict[tuple[str, str, str], tuple[list[int], RankFailure]] = {}
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
        if f.kind == FailureKind.DIED:
            lines = [f"{red}{bold}[{where}] rank died{reset}: {f.message}"]
            if f.stderr_tail:
                lines.append(f"{dim}  last stderr lines:{reset}")
                lines.extend(f"{dim}    {line}{reset}" for line in f.stderr_tail)
        elif f.traceback:
            lines = [f"{red}{bold}[{where}] remote traceback:{reset}"]
            text = f.traceback
            for rewrite in _traceback_rewriters:
                text = rewrite(text)
            body = text.rstrip("\n").splitlines()
            lines.extend(f"  {line}" for line in body[:-1])
            lines.append(f"  {red}{body[-1]}{reset}" if body else "")
        else:
            lines = [f"{red}{bold}[{where}] {f.error_type}{reset}: {f.message}"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
