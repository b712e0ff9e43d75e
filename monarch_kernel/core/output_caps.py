"""How much of a rank's file-descriptor output one request may show, and the note for the rest.

Subprocesses, C extensions and `os.write` bypass the rank's Python streams (which cap their
own output per request); the agent that reads a rank's descriptors caps them for the requests
it fans out, and the controller for the requests it sends on the ranks' lanes.
"""

from __future__ import annotations

MAX_FD_OUTPUT_PER_REQUEST = 8 << 20  # characters per rank per request (as for Python output)


def fd_dropped_note(rank: int, dropped: int, limit: int = MAX_FD_OUTPUT_PER_REQUEST) -> str:
    """What a request shows in place of the descriptor output past its cap."""
    return (f"[monarch_kernel: {dropped:,} more characters written to the file descriptors of rank {rank} "
            f"were not shown (at most {limit:,} per request); send large output to a file]\n")


def fit(text: str, used: int, limit: int = MAX_FD_OUTPUT_PER_REQUEST) -> tuple[str, int]:
    """The part of `text` that fits after `used` characters, and how many did not."""
    room = max(limit - used, 0)
    return (text, 0) if len(text) <= room else (text[:room], len(text) - room)
