"""Messages of relay trees (`wire/relay_link.py`, `agent/relays.py`, `controller/relays.py`): hosts
that pass the controller's frames on to hosts below them, for meshes of many hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monarch_kernel.wire.message_pickling import fast_pickling


@dataclass(frozen=True)
class RelayServe:
    """Controller -> a relay agent: listen on `address` for these child hosts (they prove `key`).

    `routes` says, for each host below this one, which child leads to it."""

    key: bytes
    address: str
    index: int  # this host's index
    children: tuple[int, ...]
    routes: tuple[tuple[int, int], ...]  # (descendant host, child host)


@dataclass(frozen=True)
class RelayListening:
    """A relay agent -> controller: it listens on this port of this numeric address (0: it could not, see `error`)."""

    port: int
    error: str = ""
    address: str = ""


@dataclass(frozen=True)
class RelayJoin:
    """Controller -> a child agent: connect to your relay parent, proving `key` as host `index`."""

    address: str
    port: int
    key: bytes
    index: int


@dataclass(frozen=True)
class RelayJoined:
    """A child agent -> controller: its link to the parent is up (or not: `error`)."""

    index: int
    error: str = ""


@dataclass(frozen=True)
class RelayLost:
    """An agent -> controller: the relay link to host `host` broke (that host's subtree is cut off)."""

    host: int
    why: str


@dataclass(frozen=True)
class RelayStop:
    """Controller -> agents: close your relay links (setting them up failed; the controller sends directly)."""


@dataclass(frozen=True)
class RelayDown:
    """Down a relay tree: ToRanks(ranks, body) for each (host, ranks), the body encoded once per link."""

    hosts: tuple[tuple[int, tuple[int, ...]], ...]
    body: Any


@dataclass(frozen=True)
class RelayUp:
    """Up a relay tree: what agents below sent (output and results), batched per hop, results of one
    request combined."""

    msgs: tuple[Any, ...]


fast_pickling(vars().values(), __name__)
