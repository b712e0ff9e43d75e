"""Operations for the host agents themselves (not their ranks), each waiting for its answer.

Runs on the controller loop. An operation whose host is lost, or whose mesh goes down,
fails with HostOpFailed naming the host, so a caller never waits on a dead agent.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

from monarch_kernel.controller.state import HostLink
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.ops import HostOperation


@dataclass
class Progress:
    """Files and bytes moved so far to or from one host (the notebook's thread reads it for the live line)."""

    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0


class HostOpFailed(RuntimeError):
    """A host operation failed on its host, or the host went away."""


class HostOps:
    """Operations in flight, by id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[HostLink, asyncio.Future[Any]]] = {}

    def send(self, link: HostLink, op: HostOperation) -> asyncio.Future[Any]:
        """Send an operation (`wire/ops.py`) to link's agent; the future holds its result (loop thread only)."""
        op_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[op_id] = (link, future)
        if not link.send(m.HostOp(op_id, op)):
            self._waiting.pop(op_id)
            future.set_exception(HostOpFailed(f"host {link.name} is not connected"))
        return future

    def done(self, link: HostLink, msg: m.HostOpDone) -> None:
        """An answer arrived."""
        entry = self._waiting.pop(msg.op_id, None)
        if entry is None or entry[1].done():
            return
        if msg.error:
            entry[1].set_exception(HostOpFailed(f"host {link.name}: {msg.error}"))
        else:
            entry[1].set_result(msg.result)

    def lost(self, link: HostLink, why: str) -> None:
        """Every operation waiting on link fails."""
        for op_id, (waiting_on, future) in list(self._waiting.items()):
            if waiting_on is link:
                del self._waiting[op_id]
                if not future.done():
                    future.set_exception(HostOpFailed(f"host {link.name}: {why}"))
