"""input(), getpass() and pdb on a rank: the notebook asks for the line (ranks asking alike share one
box), and Ctrl-C interrupts the wait."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import NoTerminalError
from monarch_kernel.wire.messages import InputReply, InputRequest


class NotebookInput:
    """A rank's input() and getpass(), answered by the notebook (`InputReply`, on the reader thread)."""

    def __init__(self, rank: int, send: Callable[[Any], None], current_req: Callable[[], int | None],
                 flush: Callable[[], None]):
        self._rank = rank
        self._send = send
        self._current_req = current_req
        self._flush = flush
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._answer: tuple[str, str | None] = ("", None)

    def getpass(self, prompt: str = "Password: ", stream: Any = None) -> str:
        """getpass() on a rank: a masked box in the notebook (a login token, say)."""
        return self.input(prompt, password=True)

    def input(self, prompt: object = "", *, password: bool = False) -> str:
        """input() on a rank: the notebook asks for the line."""
        req = self._current_req()
        if req is None or threading.current_thread() is not threading.main_thread():
            raise NoTerminalError(
                "input() on a rank reaches the notebook only from a %%mesh cell's own code; pass values "
                "in instead: %mesh push NAME, mesh.push(name=value), or an endpoint argument")
        self._flush()  # what the cell printed comes before the question
        with self._lock:
            self._ready.clear()
            self._send(InputRequest(self._rank, req, str(prompt), password))
            self._ready.wait()  # Ctrl-C (SIGINT from the agent) interrupts the wait
            text, error = self._answer
        if error is not None:
            raise NoTerminalError(f"input() on rank {self._rank} got no line: {error}. Pass values in "
                                  "instead: %mesh push NAME, or mesh.push(name=value)")
        return text

    def reply(self, msg: InputReply) -> None:
        """The notebook's answer (reader thread)."""
        if msg.req_id != self._current_req():
            return  # for an input() that was interrupted, in a request that is over
        self._answer = (msg.text, msg.error)
        self._ready.set()


def breakpoint_in_the_notebook(*args: Any, **kwargs: Any) -> Any:
    """breakpoint() on a rank: pdb, talking to the notebook through input(), and leaving
    SIGINT alone (pdb would take it over, and the notebook's stop button must stop)."""
    if os.environ.get("PYTHONBREAKPOINT", "pdb.set_trace") not in ("", "pdb.set_trace"):
        return sys.__breakpointhook__(*args, **kwargs)
    import pdb

    pdb.Pdb(nosigint=True).set_trace(sys._getframe(1))
    return None
