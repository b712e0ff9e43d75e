"""What ranks write to their real file descriptors 1 and 2, on its way to the controller.

Subprocesses, C extensions and `os.write` bypass the rank's Python streams (which cap
their own output per request). Here the bytes become text without splitting a character
across reads, and each rank may send at most MAX_FD_OUTPUT_PER_REQUEST characters per
request it is given; the rest is counted and reported once, before the rank's result. On
the notebook's own machine the notebook sends requests on the ranks' lanes, past the agent:
there the controller caps each request (limit None here).
"""

from __future__ import annotations

import codecs

from monarch_kernel.core.output_caps import MAX_FD_OUTPUT_PER_REQUEST, fd_dropped_note, fit


class FdOutput:
    """Decoders and budgets for the ranks of one host."""

    def __init__(self, limit: int | None = MAX_FD_OUTPUT_PER_REQUEST) -> None:
        self.limit = limit
        self._decoders: dict[tuple[int, str], codecs.IncrementalDecoder] = {}
        self._sent: dict[int, int] = {}
        self._dropped: dict[int, int] = {}

    def take(self, rank: int, stream: str, data: bytes) -> str:
        """The text of these bytes that fits the rank's budget (b"" at the end: flush what is left)."""
        decoder = self._decoders.get((rank, stream))
        if decoder is None:
            decoder = self._decoders[(rank, stream)] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(data, final=not data)
        if self.limit is None:
            return text
        text, dropped = fit(text, self._sent.get(rank, 0), self.limit)
        if dropped:
            self._dropped[rank] = self._dropped.get(rank, 0) + dropped
        self._sent[rank] = self._sent.get(rank, 0) + len(text)
        return text

    def settle(self, rank: int) -> str | None:
        """A note of what this rank's descriptors lost since its budget was refilled (None: nothing)."""
        dropped = self._dropped.pop(rank, 0)
        if not dropped:
            return None
        return fd_dropped_note(rank, dropped, self.limit or MAX_FD_OUTPUT_PER_REQUEST)

    def refill(self, ranks: tuple[int, ...]) -> None:
        """These ranks start a new request: their budgets start over."""
        for rank in ranks:
            self._sent.pop(rank, None)
