"""Which actors live in this process, by spawn key, and which of them runs the code now (for `context()`).

The rank's actor host registers each actor before its constructor runs and forgets it when it stops; the
spawning path reads the running actor's identity to name it as the creator of what it spawns.
"""

from __future__ import annotations

from monarch_kernel.actors.base import current_actor
from monarch_kernel.core.identity import ActorIdentity, root_identity

# the identities of the actors living in this process, by spawn key (the rank's actor host keeps it)
_identities: dict[str, ActorIdentity] = {}


def register_identity(key: str, identity: ActorIdentity) -> None:
    """An actor of spawn `key` lives here from now on (before its constructor runs)."""
    _identities[key] = identity


def forget_identity(key: str) -> None:
    """The actor of spawn `key` here was stopped."""
    _identities.pop(key, None)


def identity_of(key: str) -> ActorIdentity | None:
    """The identity of the actor of spawn `key` living here (None: not here)."""
    return _identities.get(key)


def current_identity() -> ActorIdentity:
    """The identity of the actor running this code (the root client's outside actors)."""
    key = current_actor.get()
    found = _identities.get(key) if key is not None else None
    return found if found is not None else root_identity()
