"""This host agent's place in its mesh's relay tree (the links: wire/relay_link.py).

A relay agent listens on its host's address until the children the controller named
have joined (each proves the mesh's relay key; strangers are refused and counted), then
stops listening. What comes down (`RelayDown`) it passes to the children whose subtrees
hold target hosts, and runs its own part. Agents in a tree send their output and results
up (`RelayUp`), batched per turn of the event loop; a request's results wait (at most
HOLD_S) for the rest of the subtree's, so that each relay sends one set of results per
request: the controller reads a few messages per broadcast, not one per host. A link
that breaks is reported to the controller (`RelayLost`), which declares the hosts cut off
lost; the agent itself goes on.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from monarch_kernel.core.addresses import numeric_address
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import relay_messages as rm
from monarch_kernel.wire.handshake_gate import ACCEPT_BACKLOG, HandshakeGate
from monarch_kernel.wire.relay_link import DOWN, UP, RelayLink, RelayRefused, handshake_as_child, handshake_as_parent, no_delay

UP_TYPES = (m.Output, m.Display, m.Gathered)  # what goes up the tree (in order); the rest goes straight
HOLD_S = 0.02  # results of a request wait this long for the rest of this subtree's, to go up as one
JOIN_WAIT_S = 30.0  # how long a relay listens for its children
CONNECT_TIMEOUT_S = 10.0


def _log(text: str) -> None:
    print(f"monarch_kernel agent: {text}", file=sys.stderr, flush=True)


def combine(msgs: list[Any]) -> list[Any]:
    """One Gathered per request, at the place of its last part (so each host's output stays before
    its results); everything else in order."""
    last: dict[int, int] = {}
    for i, msg in enumerate(msgs):
        if isinstance(msg, m.Gathered):
            last[msg.req_id] = i
    if len(last) == sum(isinstance(x, m.Gathered) for x in msgs):
        return msgs
    parts: dict[int, list[m.Result]] = {}
    for msg in msgs:
        if isinstance(msg, m.Gathered):
            parts.setdefault(msg.req_id, []).extend(msg.results)
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, m.Gathered):
            out.append(msg)
        elif last[msg.req_id] == i:
            out.append(m.Gathered(msg.req_id, tuple(parts[msg.req_id])))
    return out


class AgentRelays:
    """This agent's relay links: to its parent (if any) and to its children."""

    def __init__(self, to_controller: Callable[[Any], None], fan_out: Callable[[m.ToRanks], None]):
        self._to_controller = to_controller  # straight to the controller (never up the tree)
        self._fan_out = fan_out  # runs a ToRanks on this host's ranks
        self.index: int | None = None
        self.parent: RelayLink | None = None
        self.children: dict[int, RelayLink] = {}
        self._routes: dict[int, int] = {}  # host below us -> the child leading there
        self._batch: list[Any] = []
        self._stopped = False
        self._server: asyncio.Server | None = None  # listening for children, until they joined
        self._expected: dict[int, set[int]] = {}  # req_id -> ranks of this subtree whose results are due
        self._held: dict[int, list[m.Result]] = {}  # req_id -> results waiting for the rest

    @property
    def active(self) -> bool:
        """Whether this agent's output and results go up as RelayUp (it is part of a tree)."""
        return self.parent is not None or bool(self.children)

    # ------------------------------------------------------------ setting up
    async def serve(self, msg: rm.RelayServe) -> None:
        """Listen for the children the controller named; say the port; stop once they joined."""
        self.index, self._routes, self._stopped = msg.index, dict(msg.routes), False
        expected, joined = set(msg.children), asyncio.Event()
        gate = HandshakeGate("this agent's relay listener", _log)

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            token = gate.admit(writer)
            try:
                index, session = await handshake_as_parent(reader, writer, msg.key)
                if index not in expected or index in self.children:
                    raise RelayRefused(f"host {index} is not a child of this relay waiting to join")
            except RelayRefused as exc:
                gate.refuse(token, str(exc))  # (strangers knocking do not stop the listening: the children may come)
                return
            gate.done(token)
            no_delay(writer)
            self.children[index] = RelayLink(reader, writer, session, DOWN, self._from_child,
                                              partial(self._child_closed, index))
            if expected <= set(self.children):
                joined.set()

        try:  # the numeric address, said to the controller: the children connect to that literal only
            numeric = numeric_address(msg.address)
            server = self._server = await asyncio.start_server(accept, host=numeric, port=0, backlog=ACCEPT_BACKLOG)
        except OSError as exc:
            self._to_controller(rm.RelayListening(0, f"cannot listen on {msg.address}: {exc}"))
            return
        self._to_controller(rm.RelayListening(server.sockets[0].getsockname()[1], address=numeric))
        try:
            await asyncio.wait_for(joined.wait(), JOIN_WAIT_S)
        except TimeoutError:
            pass  # the controller times the joins out itself, and says so
        finally:
            server.close()  # nothing of ours stays listening
            gate.close()
            self._server = None

    async def join(self, msg: rm.RelayJoin) -> None:
        """Connect to the relay parent and prove the key; tell the controller how it went."""
        self.index, self._stopped = msg.index, False
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(msg.address, msg.port), CONNECT_TIMEOUT_S)
            session = await handshake_as_child(reader, writer, msg.key, msg.index)
        except (OSError, TimeoutError, RelayRefused) as exc:
            self._to_controller(rm.RelayJoined(msg.index, f"cannot join the relay at {msg.address}:{msg.port}: {exc}"))
            return
        no_delay(writer)
        self.parent = RelayLink(reader, writer, session, UP, self._from_parent, self._parent_closed)
        self._to_controller(rm.RelayJoined(msg.index))

    def stop(self) -> None:
        """Close every relay link (the controller asked, or the agent ends); nothing is reported."""
        self._stopped = True
        if self._server is not None:
            self._server.close()  # (a setup that failed: stop listening now)
        for req_id in list(self._held):
            self._release(req_id)
        self.flush()
        for link in [*self.children.values(), *([self.parent] if self.parent else [])]:
            link.close()
        self.children.clear()
        self.parent = None

    # ------------------------------------------------------------ down
    def down(self, msg: rm.RelayDown) -> None:
        """Pass a RelayDown on to the children leading to its hosts, then run this host's part."""
        mine: tuple[int, ...] = ()
        onward: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        req_id = getattr(msg.body, "req_id", None)
        if req_id is not None:
            self._expected[req_id] = {rank for _, ranks in msg.hosts for rank in ranks}
        for host, ranks in msg.hosts:
            if host == self.index:
                mine = ranks
            elif (child := self._routes.get(host)) is not None:
                onward.setdefault(child, []).append((host, ranks))
        for child, entries in onward.items():
            link = self.children.get(child)
            if link is not None:  # (a broken link was reported: the controller fails those ranks)
                link.send(rm.RelayDown(tuple(entries), msg.body))
        if mine:
            self._fan_out(m.ToRanks(mine, msg.body))

    def _from_parent(self, msg: Any) -> None:
        if isinstance(msg, rm.RelayDown):
            self.down(msg)

    # ------------------------------------------------------------ up
    def up(self, msg: Any) -> None:
        """Queue output or results for the next batch up the tree (sent at the end of this loop turn);
        results of a request that came down through here wait for the rest of this subtree's."""
        if isinstance(msg, m.Gathered) and msg.req_id in self._expected:
            self._hold(msg)
            return
        if not self._batch:
            asyncio.get_running_loop().call_soon(self.flush)
        self._batch.append(msg)

    def _hold(self, msg: m.Gathered) -> None:
        due = self._expected[msg.req_id]
        due.difference_update(result.rank for result in msg.results)
        held = self._held.get(msg.req_id)
        if held is None:
            held = self._held[msg.req_id] = []
            if due:  # the rest may be slow, or never come (a rank died): do not wait long
                asyncio.get_running_loop().call_later(HOLD_S, self._release, msg.req_id)
        held.extend(msg.results)
        if not due:
            self._release(msg.req_id)

    def _release(self, req_id: int) -> None:
        """Send the held results of a request (all of them, or those in after HOLD_S); later ones go straight."""
        self._expected.pop(req_id, None)
        held = self._held.pop(req_id, None)
        if held:
            self.up(m.Gathered(req_id, tuple(held)))

    def _from_child(self, msg: Any) -> None:
        if isinstance(msg, rm.RelayUp):
            for inner in msg.msgs:
                if isinstance(inner, UP_TYPES):
                    self.up(inner)

    def flush(self) -> None:
        """Send the batch: to the parent, or (at the top of the tree) to the controller."""
        if not self._batch:
            return
        batch, self._batch = combine(self._batch), []
        up = rm.RelayUp(tuple(batch))
        if self.parent is not None:
            self.parent.send(up)
        else:
            self._to_controller(up)

    # ------------------------------------------------------------ losses
    def _child_closed(self, index: int, exc: Exception | None) -> None:
        self.children.pop(index, None)
        if not self._stopped:
            self._to_controller(rm.RelayLost(index, f"the relay link to it closed ({exc or 'connection ended'})"))

    def _parent_closed(self, exc: Exception | None) -> None:
        self.parent = None
        if not self._stopped and self.index is not None:
            self._to_controller(rm.RelayLost(self.index, f"its relay link to its parent closed "
                                                        f"({exc or 'connection ended'})"))
