"""Fan-out through relay agents: past `branching` hosts, the controller sends to a few agents only.

The hosts form a tree in which the controller and every host have at most `branching`
children (the controller's are hosts 0..B-1; host p's are B(p+1)..B(p+1)+B-1). Work for
ranks of several hosts (cells, pushes, pulls) goes to the top host of each subtree as one
`RelayDown`, which each relay passes on (agent/relays.py); output and results come back
up the same way, combined. So bytes leaving the controller for a push to every host are
at most `branching` copies, and its work per broadcast stops growing with the hosts.

Relay links are authenticated and sealed (wire/relay_link.py) with a key made per mesh and
handed out over the controller's own channels. When a link breaks, or a relay host is
lost, every host below it is declared lost (their ranks fail, their agents are told to
stop); the rest of the mesh goes on, and `restart` rebuilds the tree. If setting the tree
up fails, the mesh runs without it (the controller sends to every host) and says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from monarch_kernel.controller.state import RELAY_BRANCHING, HostLink
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import relay_messages as rm
from monarch_kernel.wire.relay_link import new_key

DEFAULT_BRANCHING = RELAY_BRANCHING
SETUP_TIMEOUT_S = 15.0


class RelayTree:
    """Who relays to whom among `n` hosts, with at most `branching` children each."""

    def __init__(self, n: int, branching: int):
        if branching < 1:
            raise ValueError("branching must be at least 1")
        self.n = n
        self.branching = branching
        self.parents: list[int | None] = [None if i < branching else (i - branching) // branching for i in range(n)]
        self.children: dict[int, list[int]] = {}
        for host, parent in enumerate(self.parents):
            if parent is not None:
                self.children.setdefault(parent, []).append(host)

    @property
    def needed(self) -> bool:
        """Whether any host relays (more hosts than the controller's own branching)."""
        return self.n > self.branching

    def top(self, host: int) -> int:
        """The controller's child whose subtree holds `host`."""
        while (parent := self.parents[host]) is not None:
            host = parent
        return host

    def below(self, host: int) -> list[int]:
        """Every host in `host`'s subtree, itself excluded."""
        found, todo = [], list(self.children.get(host, ()))
        while todo:
            child = todo.pop()
            found.append(child)
            todo.extend(self.children.get(child, ()))
        return sorted(found)

    def routes(self, host: int) -> tuple[tuple[int, int], ...]:
        """(host below, the child of `host` leading to it) for the whole subtree."""
        return tuple((below, child) for child in self.children.get(host, ())
                     for below in [child, *self.below(child)])


class ControllerRelays:
    """The controller's side of a mesh's relay tree (loop thread only)."""

    def __init__(self, branching: int, notice: Callable[[str], None]):
        self.branching = branching
        self._notice = notice  # tells the notebook (a setup that failed, a cut subtree)
        self.tree: RelayTree | None = None  # set while the tree carries traffic
        self._listening: dict[int, asyncio.Future[rm.RelayListening]] = {}
        self._joined: dict[int, asyncio.Future[rm.RelayJoined]] = {}

    @property
    def active(self) -> bool:
        """Whether traffic goes through relays."""
        return self.tree is not None

    async def setup(self, links: list[HostLink]) -> None:
        """Build the tree over these (connected) hosts, or say why not and run without it."""
        self.tree = None
        tree = RelayTree(len(links), self.branching)
        if not tree.needed:
            return
        try:
            await asyncio.wait_for(self._build(tree, links), SETUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure (a timeout too): run direct
            for link in links:
                link.send(rm.RelayStop())
            why = str(exc) or f"{type(exc).__name__} after {SETUP_TIMEOUT_S:g} s"
            self._notice(f"relays between the {len(links)} hosts could not be set up ({why}); the controller "
                         "sends to every host itself (check that the hosts reach each other over TCP)\n")
            return
        finally:
            self._listening.clear()
            self._joined.clear()
        self.tree = tree

    async def _build(self, tree: RelayTree, links: list[HostLink]) -> None:
        loop = asyncio.get_running_loop()
        key = new_key()
        relays = sorted(tree.children)
        for host in relays:
            self._listening[host] = loop.create_future()
            links[host].send(rm.RelayServe(key, _address(links[host]), host, tuple(tree.children[host]),
                                          tree.routes(host)))
        where: dict[int, tuple[str, int]] = {}  # the literal address and port each relay bound
        for host, listening in zip(relays, await asyncio.gather(*(self._listening[h] for h in relays))):
            if not listening.port or not listening.address:
                raise RuntimeError(f"host {links[host].name}: {listening.error or 'it did not say where it listens'}")
            where[host] = (listening.address, listening.port)
        children = [c for host in relays for c in tree.children[host]]
        for child in children:
            self._joined[child] = loop.create_future()
            parent = tree.parents[child]
            assert parent is not None
            links[child].send(rm.RelayJoin(*where[parent], key, child))
        for child, joined in zip(children, await asyncio.gather(*(self._joined[c] for c in children))):
            if joined.error:
                raise RuntimeError(f"host {links[child].name}: {joined.error}")

    def listening(self, link: HostLink, msg: rm.RelayListening) -> None:
        """A relay host says where it listens."""
        waiting = self._listening.get(link.index)
        if waiting is not None and not waiting.done():
            waiting.set_result(msg)

    def joined(self, link: HostLink, msg: rm.RelayJoined) -> None:
        """A child host says whether it joined its relay."""
        waiting = self._joined.get(link.index)
        if waiting is not None and not waiting.done():
            waiting.set_result(msg)

    def lost(self, link: HostLink, exc: Exception | None) -> None:
        """A host is lost while setting up: whoever waits on it hears so."""
        for table in (self._listening, self._joined):
            waiting = table.get(link.index)
            if waiting is not None and not waiting.done():
                waiting.set_exception(RuntimeError(f"host {link.name} was lost ({exc})"))

    def cut_off(self, host: int) -> list[int]:
        """The hosts that lose their way to the controller with `host`'s relay (none without a tree)."""
        return self.tree.below(host) if self.tree is not None else []

    def stop(self) -> None:
        """The links are closing (down or restart): traffic goes direct until the next setup."""
        self.tree = None

    def route(self, links: list[HostLink], by_host: Iterable[tuple[HostLink, tuple[int, ...]]], body: Any) -> None:
        """Send ToRanks(ranks, body) to each host: direct, or as one RelayDown per subtree via its top host."""
        tree = self.tree
        assert tree is not None
        groups: dict[int, list[tuple[HostLink, tuple[int, ...]]]] = {}
        for link, local in by_host:
            groups.setdefault(tree.top(link.index), []).append((link, local))
        for top, entries in groups.items():
            if len(entries) == 1 and entries[0][0].index == top:
                links[top].send(m.ToRanks(entries[0][1], body))
            else:  # (a lost top host: its subtree was declared lost, so its ranks are not among these)
                links[top].send(rm.RelayDown(tuple((link.index, local) for link, local in entries), body))


def _address(link: HostLink) -> str:
    """Where the other hosts reach this one: the address the controller reached it at."""
    if link.host is None or not link.host.address:
        raise RuntimeError(f"host {link.name} has no known address for the other hosts to reach")
    return link.host.address
