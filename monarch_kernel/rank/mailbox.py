"""One actor on a rank: its instance, the endpoints it answers, and the calls waiting for it."""

from __future__ import annotations

import contextvars
import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.actors.base import current_actor, current_point, is_endpoint, takes_port
from monarch_kernel.core.shape import Point, Shape
from monarch_kernel.core.supervision import SUPERVISE
from monarch_kernel.wire.messages import ActorCall


@dataclass(eq=False)
class Mailbox:
    """An actor and its queue: one call runs at a time (`busy`), the rest wait in arrival order."""

    name: str
    key: str
    instance: Any
    shape: Shape
    point: Point
    queue: deque = field(default_factory=deque)
    busy: bool = False
    in_async: bool = False  # what keeps it busy is an async endpoint (on the rank's event loop)
    stopped: bool = False  # stopped or replaced: calls that come now are told so
    endpoints: dict = field(default_factory=dict)  # name -> (bound method, is async, label, takes a port)

    def endpoint(self, name: str) -> tuple[Any, bool, str, bool] | None:
        """The endpoint called `name` (looked up once per name), or None."""
        found = self.endpoints.get(name)
        if found is None:
            method = getattr(self.instance, name, None)
            if method is None or not (is_endpoint(method) or name == SUPERVISE):
                return None  # only @endpoint methods answer calls (and __supervise__, asked by the controller)
            found = self.endpoints[name] = (method, inspect.iscoroutinefunction(method),
                                            f"{type(self.instance).__name__}.{name}", takes_port(method))
        return found


def point_of(box: Mailbox, msg: ActorCall) -> Point:
    """current_rank() in an endpoint: the actor's point in the (sliced) mesh the call was sent through."""
    through = msg.through
    found = None if through is None else Shape(*through).numbered_point(box.shape.ranks[box.point.rank])
    return box.point if found is None else found


def context_at(point: Point, key: str) -> contextvars.Context:
    """A context in which current_rank() is `point` and the current actor `key` (for an async endpoint)."""
    ctx = contextvars.copy_context()
    ctx.run(current_point.set, point)
    ctx.run(current_actor.set, key)
    return ctx
