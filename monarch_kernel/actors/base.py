"""What an actor class is made of: the Actor base class, @endpoint, and current_rank().

These live apart from the call machinery because both sides need them: the notebook
defines actor classes, and ranks build and serve their instances.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import linecache
import logging
import os
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.shape import Point, Shape
from monarch_kernel.wire.actor_messages import SYSTEM_ACTOR as SYSTEM_ACTOR

ENDPOINT_MARK = "_monarch_endpoint"
PORT_MARK = "_monarch_explicit_port"
CONCURRENT_MARK = "_monarch_concurrent"
# Monarch's flag on an endpoint: whether its answer is sent through a port rather than returned when the call ends
# (explicit_response_port, and every concurrent endpoint); Monarch programs and tests read it
ANSWERS_LATER = "_explicit_response_port"

# The coordinates of the actor whose endpoint (or constructor) runs in this context.
current_point: contextvars.ContextVar[Point | None] = contextvars.ContextVar("monarch_current_point", default=None)
# The spawn key ("name#N") of the actor whose endpoint (or constructor) runs in this context: it owns
# the actor meshes spawned there.
current_actor: contextvars.ContextVar[str | None] = contextvars.ContextVar("monarch_current_actor", default=None)


def endpoint(fn: Callable[..., Any] | None = None, *, explicit_response_port: bool = False,
             **_options: Any) -> Any:
    """Mark an Actor method (sync or `async def`) as callable from other processes.

    `@endpoint` or `@endpoint(explicit_response_port=True)`: then the method's first argument
    (after self) is a Port, and the caller's answer is what the method sends through it (now,
    or later from another endpoint); its return value is ignored. Other options of Monarch's
    decorator (`propagate`, `instrument`) are accepted and have no effect here.
    """

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        setattr(method, ENDPOINT_MARK, True)
        if explicit_response_port:
            setattr(method, PORT_MARK, True)
        setattr(method, ANSWERS_LATER, explicit_response_port)
        return method

    return mark if fn is None else mark(fn)


def concurrent_endpoint(fn: Callable[..., Any] | None = None, *, explicit_response_port: bool = False,
                        **_options: Any) -> Any:
    """Mark an `async def` Actor method as an endpoint whose calls run beside the actor's others.

    A plain endpoint's call holds the actor's mailbox until it ends; a call to a concurrent one is
    started as a task on the actor's event loop and the mailbox goes on to the next call at once (so
    one call may wait for another, as with an asyncio.Event). Stopping the actor cancels the tasks
    still running, before its `__cleanup__`. As in Monarch: only `async def` methods, and not
    stacked on @endpoint.
    """

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(method, ENDPOINT_MARK, False):
            raise ValueError(f"concurrent_endpoint does not wrap @endpoint: use @concurrent_endpoint alone on "
                             f"{getattr(method, '__qualname__', method)!r}")
        if not inspect.iscoroutinefunction(method):
            raise ValueError(f"concurrent_endpoint can only wrap async endpoints: {getattr(method, '__qualname__', method)!r} "
                             "is not `async def` (use @endpoint for a sync method)")
        endpoint(method, explicit_response_port=explicit_response_port)
        setattr(method, CONCURRENT_MARK, True)
        setattr(method, ANSWERS_LATER, True)  # (its answer comes from the task it starts)
        return method

    return mark if fn is None else mark(fn)


def is_concurrent(method: Any) -> bool:
    """Whether an endpoint was marked with @concurrent_endpoint (its calls do not hold the mailbox)."""
    return bool(getattr(getattr(method, "__func__", method), CONCURRENT_MARK, False))


def is_endpoint(method: Any) -> bool:
    """Whether a method (bound or not) was marked with @endpoint."""
    return bool(getattr(getattr(method, "__func__", method), ENDPOINT_MARK, False))


def takes_port(method: Any) -> bool:
    """Whether an endpoint answers through a Port it is given (explicit_response_port=True)."""
    return bool(getattr(getattr(method, "__func__", method), PORT_MARK, False))


class Actor:
    """Base class of actors: subclass it, mark methods with @endpoint, spawn on a mesh."""

    _endpoints: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: set[str] = set()
        for klass in cls.__mro__:
            names.update(n for n, v in vars(klass).items() if getattr(v, ENDPOINT_MARK, False))
        cls._endpoints = frozenset(names)

    @functools.cached_property
    def logger(self) -> logging.Logger:
        """A logger named after the actor's class (level DEBUG), as Monarch's actors have; what it logs on a
        rank shows with the rank's output."""
        found = logging.getLogger(type(self).__name__)
        found.setLevel(logging.DEBUG)
        return found


def check_endpoint_kinds(cls: type) -> None:
    """Monarch's rule for an actor class spawned on a ProcMesh: its endpoints are all sync or all async
    (and an async `__cleanup__` needs async endpoints). Raises ValueError, as Monarch's spawn does."""
    sync = sorted(n for n in cls._endpoints if not inspect.iscoroutinefunction(getattr(cls, n)))  # type: ignore[attr-defined]
    asynchronous = sorted(n for n in cls._endpoints if inspect.iscoroutinefunction(getattr(cls, n)))  # type: ignore[attr-defined]
    if sync and asynchronous:
        raise ValueError(f"{cls.__name__} mixes both async and sync endpoints: a sync endpoint that waits would stall "
                         f"the async ones on the actor's event loop, so Monarch refuses it; make them all `async def` "
                         f"or all plain `def` (sync: {sync}, async: {asynchronous})")
    if sync and inspect.iscoroutinefunction(getattr(cls, "__cleanup__", None)):
        raise ValueError(f"{cls.__name__} has sync endpoints but an async __cleanup__: make __cleanup__ a plain `def` "
                         f"too (sync: {sync})")


def owner_label(key: str, rank: int) -> str:
    """How a report names the actor (by its spawn key) that owns an actor mesh or sent a call."""
    return f"actor mesh {key.split('#')[0]!r} on rank {rank}"


def current_rank() -> Point:
    """Inside an endpoint: this actor's coordinates (with .rank) in the actor mesh or slice the call was
    sent through, numbered from 0 there, as in Monarch (in a constructor: in the mesh spawned on).

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


def current_size() -> dict[str, int]:
    """Inside an endpoint: the size of each dim of this actor's mesh, e.g. {'gpus': 4}."""
    return dict(current_rank().extent)


# An endpoint's parameters after self (and after the port of one that answers through a port), each as
# (name, inspect kind, has a default): small and picklable, so handles check calls wherever they travel.
Parameters = tuple[tuple[str, int, bool], ...]


def endpoint_parameters(cls: type) -> dict[str, Parameters]:
    """The parameters that callers pass to each endpoint of an actor class."""
    found: dict[str, Parameters] = {}
    for name in getattr(cls, "_endpoints", ()):
        method = getattr(cls, name)
        try:
            params = list(inspect.signature(method).parameters.values())[1:]  # (self)
        except (TypeError, ValueError):
            continue  # a callable whose signature Python cannot tell: not checked
        if takes_port(method):
            params = params[1:]
        found[name] = tuple((p.name, int(p.kind), p.default is not inspect.Parameter.empty) for p in params)
    return found


_KINDS = {int(k): k for k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY,
                               inspect.Parameter.VAR_KEYWORD)}


@functools.lru_cache(maxsize=1024)
def _plain_arity(params: Parameters) -> int:
    """How many arguments an endpoint takes when all are plain positional ones without defaults (else -1)."""
    plain = all(kind == inspect.Parameter.POSITIONAL_OR_KEYWORD and not has_default for _, kind, has_default in params)
    return len(params) if plain else -1


@functools.lru_cache(maxsize=1024)
def _signature(params: Parameters) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(name, _KINDS[kind], default=None if has_default else inspect.Parameter.empty)
                              for name, kind, has_default in params])


def check_arguments(endpoint_name: str, params: Parameters, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise TypeError, as calling the method would, if it cannot take these arguments (before any is sent)."""
    if not kwargs and len(args) == _plain_arity(params):
        return  # (the common case, a few positional arguments: no Signature to bind)
    try:
        _signature(params).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"endpoint {endpoint_name}() cannot take these arguments: {exc}") from None


def class_sources(cls: type) -> dict[str, list[str]]:
    """Source lines of the cells that define cls (and its bases), for tracebacks where it runs."""
    sources: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        for value in vars(klass).values():
            fn = getattr(value, "__func__", value)
            code = getattr(fn, "__code__", None)
            if code is None or code.co_filename in sources or os.path.exists(code.co_filename):
                continue
            lines = linecache.getlines(code.co_filename)
            if lines:
                sources[code.co_filename] = lines
    return sources
