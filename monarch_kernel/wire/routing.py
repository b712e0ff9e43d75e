"""One router for actor calls, used by every process that passes them on (agent, controller).

A router sits between callers and the ranks that serve calls. It sends each call to the
next hop towards its ranks (a rank's own connection, or a host agent's link), grouped so
that each hop gets one message; ranks it does not serve go upstream. It remembers which
ranks owe which call an answer, so that a rank's death turns at once into failure
replies, and it sends each reply back towards its caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from monarch_kernel.wire.calls import CallTracker, death_reply
from monarch_kernel.wire.messages import ActorCall, ActorReply, CancelCall

Send = Callable[[Any], object]  # sends one message on towards a rank (its result is ignored)


class CallRouter:
    """Routes calls, cancels and replies for one routing process (loop thread only).

    `next_hop(rank)`: how to send towards a rank this router serves (None: it is dead or
    unreachable). `serves(rank)`: whether the rank is below this router. `upstream`:
    where everything else goes (None at the top). `deliver_here`: replies to calls this
    process made itself (caller id `here_id`). `why_dead(rank)`: the text of a death reply.
    """

    def __init__(self, *, next_hop: Callable[[int], Send | None], serves: Callable[[int], bool],
                 why_dead: Callable[[int], str], upstream: Send | None = None,
                 deliver_here: Callable[[ActorReply], None] | None = None, here_id: int | None = None):
        self._next_hop = next_hop
        self._serves = serves
        self._why_dead = why_dead
        self._upstream = upstream
        self._deliver_here = deliver_here
        self._here_id = here_id
        self.owed = CallTracker()

    def call(self, msg: ActorCall, *, from_above: bool = False) -> None:
        """Send a call on towards its ranks; ranks that cannot answer answer with their death.

        from_above: the call came from upstream, so ranks not served here are not sent back.
        """
        hops, dead, away = self._group(msg.ranks)
        for rank in dead:
            self.reply(death_reply(msg.caller, msg.call_id, rank, self._why_dead(rank), to_port=msg.to_port))
        for send, ranks in hops.items():
            if not msg.to_port:  # a port's messages come when they come: nobody waits on them here
                self.owed.add(msg.caller, msg.call_id, ranks)
            send(msg if len(ranks) == len(msg.ranks) else replace(msg, ranks=tuple(ranks)))
        if away:
            self._away(msg, away, from_above)

    def cancel(self, msg: CancelCall, *, from_above: bool = False) -> None:
        """Pass a cancellation on towards its ranks (nothing to do for dead ones)."""
        hops, _, away = self._group(msg.ranks)
        for send, ranks in hops.items():
            send(msg if len(ranks) == len(msg.ranks) else replace(msg, ranks=tuple(ranks)))
        if away:
            self._away(msg, away, from_above)

    def reply(self, reply: ActorReply, *, owed: bool = False) -> None:
        """Send a reply towards its caller; with owed=True, only if that rank still owed it."""
        if owed and not reply.to_port and not self.owed.answered(reply.caller, reply.call_id, reply.rank):
            return  # late or duplicate (its death was already reported)
        if reply.caller == self._here_id and self._deliver_here is not None:
            self._deliver_here(reply)
        elif self._serves(reply.caller):
            send = self._next_hop(reply.caller)
            if send is not None:
                send(reply)
        elif self._upstream is not None:
            self._upstream(reply)

    def rank_died(self, rank: int, why: str) -> None:
        """Answer every call still owed by a dead rank with its death."""
        for caller, call_id in self.owed.owed_by(rank):
            if self.owed.answered(caller, call_id, rank):
                self.reply(death_reply(caller, call_id, rank, why))

    def forget(self) -> None:
        """Drop what is owed (the ranks were replaced)."""
        self.owed = CallTracker()

    def _group(self, ranks: tuple[int, ...]) -> tuple[dict[Send, list[int]], list[int], list[int]]:
        """Ranks by next hop; ranks served here that cannot be reached; ranks not served here."""
        hops: dict[Send, list[int]] = {}
        dead, away = [], []
        for rank in ranks:
            if not self._serves(rank):
                away.append(rank)
            elif (send := self._next_hop(rank)) is None:
                dead.append(rank)
            else:
                hops.setdefault(send, []).append(rank)
        return hops, dead, away

    def _away(self, msg: ActorCall | CancelCall, ranks: list[int], from_above: bool) -> None:
        if self._upstream is not None and not from_above:
            self._upstream(replace(msg, ranks=tuple(ranks)))
        elif isinstance(msg, ActorCall):
            for rank in ranks:
                self.reply(death_reply(msg.caller, msg.call_id, rank, f"rank {rank} is not in this mesh",
                                       to_port=msg.to_port))
