"""Monarch's helpers over actor meshes: `send` (call without waiting, answers to a port or
nowhere) and `Accumulator` (fold the answers of a call into one value)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch_kernel.actors.client import EndpointHandle
from monarch_kernel.actors.ports import Port
from monarch_kernel.core.future import FoldedFuture, Future


def send(endpoint: EndpointHandle, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
         port: Port[Any] | None = None, selection: str = "all") -> None:
    """Call an endpoint without waiting (Monarch's `send`): answers go through `port`, or nowhere."""
    if port is None:
        if selection == "choose":
            endpoint.choose(*args, **(kwargs or {}))
        else:
            endpoint.broadcast(*args, **(kwargs or {}))
        return
    endpoint.send_to_port(port, tuple(args), dict(kwargs or {}), selection)


class Accumulator:
    """Fold the answers of a call into one value: `Accumulator(counters.value, 0, operator.add)`."""

    def __init__(self, endpoint: EndpointHandle, identity: Any, combine: Callable[[Any, Any], Any]):
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call every actor (`endpoint.stream(*args, **kwargs)`); the future gives
        combine(...combine(identity, a1)..., aN), the answers in arrival order."""
        return FoldedFuture(list(self._endpoint.stream(*args, **kwargs)), self._identity, self._combine)
