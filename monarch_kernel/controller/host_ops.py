"""Operations for the host agents themselves (not their ranks), each waiting for its answer.

Runs on the controller loop. An operation whose host is lost, or whose mesh goes down,
fails with HostOpFailed naming the host, so a caller never waits on a dead agent.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, TypeVar

from monarch_kernel.controller.state import HostLink
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.ops import Answering, is_host_operation

Answer = TypeVar("Answer")


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
        self._waiting: dict[int, tuple[HostLink, asyncio.Future[Any], type]] = {}

    def send(self, link: HostLink, op: Answering[Answer]) -> asyncio.Future[Answer]:
        """Send an operation (`wire/ops.py`) to link's agent; the future holds its typed answer (loop thread only)."""
        if not is_host_operation(op):
            raise TypeError(f"{type(op).__name__} is not a host operation (wire/ops.py)")
        op_id = next(self._ids)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[op_id] = (link, future, type(op).answer)
        if not link.send(m.HostOp(op_id, op)):
            self._waiting.pop(op_id)
            future.set_exception(HostOpFailed(f"host {link.name} is not connected"))
        return future

    def done(self, link: HostLink, msg: m.HostOpDone) -> None:
        """An answer arrived."""
        entry = self._waiting.pop(msg.op_id, None)
        if entry is None or entry[1].done():
            return
        _, future, answer = entry
        if msg.error:
            future.set_exception(HostOpFailed(f"host {link.name}: {msg.error}"))
        elif not isinstance(msg.result, answer):
            future.set_exception(HostOpFailed(f"host {link.name} answered {type(msg.result).__name__} where "
                                              f"{answer.__name__} was due (another monarch_kernel version?)"))
        else:
            future.set_result(msg.result)

    def lost(self, link: HostLink, why: str) -> None:
        """Every operation waiting on link fails."""
        for op_id, (waiting_on, future, _) in list(self._waiting.items()):
            if waiting_on is link:
                del self._waiting[op_id]
                if not future.done():
                    future.set_exception(HostOpFailed(f"host {link.name}: {why}"))
