"""What an actor class is made of: the Actor base class, @endpoint, and current_rank().

These live apart from the call machinery because both sides need them: the notebook
defines actor classes, and ranks build and serve their instances.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.shape import Point, Shape

ENDPOINT_MARK = "_monarch_endpoint"

# The coordinates of the actor whose endpoint (or constructor) runs in this context.
current_point: contextvars.ContextVar[Point | None] = contextvars.ContextVar("monarch_current_point", default=None)


def endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an Actor method (sync or `async def`) as callable from other processes."""
    setattr(fn, ENDPOINT_MARK, True)
    return fn


def is_endpoint(method: Any) -> bool:
    """Whether a method (bound or not) was marked with @endpoint."""
    return bool(getattr(getattr(method, "__func__", method), ENDPOINT_MARK, False))


class Actor:
    """Base class of actors: subclass it, mark methods with @endpoint, spawn on a mesh."""

    _endpoints: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: set[str] = set()
        for klass in cls.__mro__:
            names.update(n for n, v in vars(klass).items() if getattr(v, ENDPOINT_MARK, False))
        cls._endpoints = frozenset(names)


def current_rank() -> Point:
    """Inside an endpoint: this actor's coordinates in its actor mesh (with .rank).

    In a `%%mesh` cell: this rank's coordinates in the whole mesh.
    """
    point = current_point.get()
    if point is not None:
        return point
    if "RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        raise MeshUsageError("current_rank() tells where code runs on a mesh; call it in an endpoint or %%mesh cell")
    rank, per_host = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ.get("WORLD_SIZE", per_host))
    shape = Shape.grid(hosts=world // per_host, gpus=per_host)
    return next(p for p in shape.points() if p.rank == rank)
