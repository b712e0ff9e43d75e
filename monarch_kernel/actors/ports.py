"""Ports and channels, in the style of PyTorch Monarch: answers sent later, or many times.

>>> port, receiver = Channel.open()      # in the notebook or in an endpoint
>>> generators.run.broadcast(port)       # the actors send through it: port.send(x)
>>> receiver.recv().get(timeout=10)      # the next message, in arrival order

A Port names its receiving end by (owner, id): the owner is the process that opened it
(the notebook, or a rank). Messages travel as actor replies marked `to_port`, routed like
replies towards their owner, and wait in the owner's `OpenPort` until taken.

An endpoint marked `@endpoint(explicit_response_port=True)` gets a Port as its first
argument: its caller's answer is what it sends through that port, now or later (from
another endpoint of the same rank).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from monarch_kernel.core.errors import ActorError, MeshNotRunningError, MeshUsageError
from monarch_kernel.core.failures import FailureKind, RankFailure
from monarch_kernel.core.future import Future
from monarch_kernel.wire.calls import PORTS, CallSender, OpenPort, find_sender
from monarch_kernel.wire.describe import describe_failure
from monarch_kernel.wire.messages import CONTROLLER, ActorReply, Failure
from monarch_kernel.wire.serialization import seal, unseal

R = TypeVar("R")


def _here() -> CallSender | None:
    """The sender of this process when it is a rank (None in the notebook)."""
    sender = find_sender("")
    return sender if sender is not None and sender.own_rank is not None else None


class Port(Generic[R]):
    """Where to send values for someone to receive: `port.send(value)`, `port.exception(exc)`.

    A Port can travel as an argument or a value to any actor of the same mesh.
    """

    def __init__(self, owner: int, port_id: int, mesh: str = "", *, answers: int | None = None):
        self._owner = owner  # caller id of the process that receives (CONTROLLER: the notebook)
        self._port_id = port_id  # the OpenPort's id there, or the call's id for a call's port
        self._mesh = mesh
        self._answers = answers  # a call's port: the rank whose answer it carries

    def send(self, obj: R) -> None:
        """Send a value (no waiting); the receiver gets them in the order sent."""
        self._deliver(obj, None)

    def exception(self, exc: BaseException) -> None:
        """Send an error: the receiver's recv() (or the caller's get()) raises it."""
        self._deliver(None, describe_failure(exc))

    def _deliver(self, obj: Any, failure: Failure | None) -> None:
        if self._answers is not None:  # the answer to a call: only the rank that got the call can give it
            here = _here()
            if here is None or here.own_rank != self._answers:
                raise MeshUsageError(f"this port answers a call made to rank {self._answers}; send through it "
                                     "on that rank (for values sent from elsewhere, open a Channel)")
            if not here.answer(self._owner, self._port_id, obj, failure):
                raise MeshUsageError("this port already answered its call (a call's port answers once; "
                                     "open a Channel to send many values)")
            return
        sender = _here() or find_sender(self._mesh)
        me = sender.caller_id if sender is not None else CONTROLLER
        value = None if failure is not None else seal(obj)
        away = self._mesh if sender is not None and sender.other_mesh(self._mesh) else ""
        msg = ActorReply(self._owner, self._port_id, me, value, failure, to_port=True, mesh=away)
        if (me == self._owner and not away) or sender is None:
            if me != self._owner:
                raise MeshNotRunningError("this port belongs to a rank of a mesh that is not reachable from here")
            PORTS.deliver(msg)  # this process opened it
            return
        sender.send_port(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Port, (self._owner, self._port_id, self._mesh), {"_answers": self._answers})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._answers = state["_answers"]

    def __repr__(self) -> str:
        if self._answers is not None:
            return f"<Port answering call {self._port_id} on rank {self._answers}>"
        owner = "the notebook" if self._owner == CONTROLLER else f"rank {self._owner}"
        return f"<Port {self._port_id} of {owner}>"


class PortReceiver(Generic[R]):
    """The receiving end of a Channel: `recv()` gives a Future of the next message."""

    def __init__(self, port: OpenPort, ranked: bool = False, held: _Held | None = None):
        self._port = port
        self._ranked = ranked
        self._held = held or _Held(port)  # the port closes when no receiver of it is left

    def recv(self, timeout: float | None = None) -> Future[R]:
        """The next message (in arrival order); `.get(timeout)` or await it (`timeout`: get()'s default)."""
        return _Received(self._port, self._ranked, timeout, self._held)

    def ranked(self) -> PortReceiver[tuple[int, R]]:
        """A receiver of (sender's rank, value) pairs from the same port (the notebook's rank is -1)."""
        return PortReceiver(self._port, True, self._held)


class _Held:
    """Keeps a port open while a receiver of it lives."""

    def __init__(self, port: OpenPort):
        weakref.finalize(self, PORTS.close, port.port_id)


class Channel(Generic[R]):
    """Opens ports: `port, receiver = Channel.open()` (Monarch's name)."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        """A new port owned by this process, and its receiver (`once`: it takes one message)."""
        opened = PORTS.open(once)
        here = _here()
        if here is None:
            return Port(CONTROLLER, opened.port_id), PortReceiver(opened)
        return Port(here.caller_id, opened.port_id, here.mesh_name), PortReceiver(opened)  # (any mesh's actors may send)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[R], PortReceiver[tuple[int, R]]]:
        """As open(), with a receiver of (sender's rank, value) pairs."""
        port: Port[R]
        receiver: PortReceiver[R]
        port, receiver = Channel.open(once)
        return port, receiver.ranked()


def open_forwarding(forward: Callable[[ActorReply], None]) -> tuple[tuple[int, int, str], int]:
    """A port of this process that hands each message to `forward` (on the thread that delivers it): the address
    to send through (owner, port id, mesh: what `Port(*address)` takes) and its id, for `PORTS.close`."""
    opened = PORTS.open_forwarding(forward)
    here = _here()
    if here is None:
        return (CONTROLLER, opened.port_id, ""), opened.port_id
    return (here.caller_id, opened.port_id, here.mesh_name), opened.port_id


class _Received(Future[Any]):
    """The next message of an open port."""

    def __init__(self, port: OpenPort, ranked: bool, timeout: float | None = None, held: _Held | None = None):
        super().__init__(timeout)
        self._port = port
        self._held = held  # the port stays open while this future waits, even if its receiver is dropped
        self._ranked = ranked
        self._taken: ActorReply | None = None
        self._take_lock = threading.Lock()

    def done(self) -> bool:
        """Whether a message is there for this future."""
        return self._taken is not None or self._port.ready()

    def _wait(self, timeout: float | None) -> bool:
        if self._taken is not None:
            return True
        here = _here()
        if here is not None:
            return here.wait_until(self._port.ready, timeout)  # (a rank's wait, which is woken by its deliveries)
        return self._port.wait(timeout)

    async def _wait_async(self) -> None:
        if self._taken is None:
            await self._port.wait_async()

    def _cancel(self) -> None:
        """Nothing runs on behalf of a receive: stopping it is just not waiting."""

    def _finish(self) -> Any:
        with self._take_lock:
            if self._taken is None:
                self._taken = self._port.take()
        msg = self._taken
        if msg.failure is not None:
            f = msg.failure
            where = "the notebook" if msg.rank == CONTROLLER else f"rank {msg.rank}"
            raise ActorError(f"a message through a port from {where} was an error: {f.error_type}: {f.message}",
                             [RankFailure(msg.rank, "", FailureKind.EXCEPTION, f.error_type, f.message,
                                          f.traceback)])
        value = None if msg.value is None else unseal(msg.value)
        return (msg.rank, value) if self._ranked else value

    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        return error_type(f"waiting for a message through a port {why}", [])
