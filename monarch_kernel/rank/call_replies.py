"""How a rank answers the actor calls it serves: the way each call came (a direct lane, this rank
itself, or the agent), with what the endpoint returned or why it failed, once; and the calls whose
endpoint took a Port, answered through it later (from any thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed, SerializationError
from monarch_kernel.rank.mailbox import Mailbox
from monarch_kernel.rank.runs import Runs
from monarch_kernel.wire.calls import CallKey
from monarch_kernel.wire.messages import ActorCall, ActorReply, Failure
from monarch_kernel.wire.serialization import seal


class CallReplies:
    """The replies of one rank's actors."""

    def __init__(self, rank: int, send: Callable[[Any], None], shm_dir: str | None, runs: Runs) -> None:
        self._rank = rank
        self._send = send  # to the agent: the way a call came unless it came another
        self._shm_dir = shm_dir
        self._runs = runs
        self._lock = threading.Lock()
        self._via: dict[CallKey, Callable[[Any], None]] = {}  # calls that came another way -> its send
        self._answering: dict[CallKey, ActorCall] = {}  # calls whose endpoint took a Port and has not answered

    def came_by(self, msg: ActorCall, send: Callable[[Any], None]) -> None:
        """Call `msg` came another way than the agent's (a lane, this rank): its reply goes back by `send`."""
        with self._lock:
            self._via[(msg.caller, msg.call_id)] = send

    def expect_port_answer(self, msg: ActorCall) -> None:
        """The endpoint of `msg` answers through the port it was given (now, or later)."""
        with self._lock:
            self._answering[(msg.caller, msg.call_id)] = msg

    def answer(self, box: Mailbox, msg: ActorCall, value: Any, failure: Failure | None, seconds: float) -> None:
        """An endpoint ended: reply with what it returned, unless it answers through its port."""
        found = box.endpoint(msg.endpoint)
        if found is None or not found[3]:
            self.reply(msg, value, failure, seconds)
        elif failure is not None:  # it raised before answering: the caller hears why (once)
            if msg.to_port:
                self.reply(msg, None, failure, seconds)
            else:
                self.through_port(msg.caller, msg.call_id, None, failure)

    def through_port(self, caller: int, call_id: int, value: Any, failure: Failure | None) -> bool:
        """Answer a call whose endpoint took a Port (any thread); False if it has no call waiting."""
        with self._lock:
            msg = self._answering.pop((caller, call_id), None)
        if msg is None:
            return False
        self.reply(msg, value, failure)
        return True

    def reply(self, msg: ActorCall, value: Any, failure: Failure | None, seconds: float | None = None) -> None:
        """Send call `msg` its reply (any thread)."""
        key = (msg.caller, msg.call_id)
        aborted = self._runs.answered(key)
        with self._lock:
            send = self._via.pop(key, self._send)
        sealed = None
        if failure is None and msg.want_value and value is not None:
            try:
                sealed = seal(value, shm_dir=None if msg.from_mesh else self._shm_dir)  # (not another mesh's files)
            except SerializationError as exc:
                failure = Failure("SerializationError", f"the reply of {msg.endpoint} could not be sent: {exc}", "")
        try:
            send(ActorReply(msg.caller, msg.call_id, self._rank, sealed, failure, seconds, to_port=msg.to_port,
                            aborted=aborted))
        except ConnectionClosed:
            pass  # the caller went away
