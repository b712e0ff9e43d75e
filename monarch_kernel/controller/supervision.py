"""Failures of actor meshes that actors own, sent to their owners' `__supervise__`.

An actor that spawns an actor mesh owns it (its rank says so with `OwnActors`). When a
rank of an owned mesh dies, or an actor of it fails (`ActorFailed`), the controller calls the
owner's `__supervise__(failure)` like an endpoint; so too the sender's, when a broadcast that
an actor sent fails. A true
answer ends it; after a false one, a missing `__supervise__`, or an exception in it, the owner
fails too (`FailActor`: its calls say so, as in Monarch) and the failure goes on to the owner's
own owner, up to the notebook's `unhandled_fault_hook`. (Meshes the
notebook owns are watched in the notebook itself.)

A spawning actor's `OwnActors` and a death of the new actors' rank come on different paths (the
owner's rank, the new rank's host), so either may come first: an actor's spawn returns only once
this controller noted the owner (`OwnActors.known`), and a rank that died before the note arrived
is told to the owner as the note arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from monarch_kernel.core.failures import FailureKind
from monarch_kernel.core.supervision import SUPERVISE, MeshFailure, report_unhandled
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.actor_messages import SYSTEM_ACTOR
from monarch_kernel.wire.calls import CallTable
from monarch_kernel.wire.ops import FailActor
from monarch_kernel.wire.serialization import seal, unseal


class Supervisors:
    """Who owns which actor mesh, and where its failures go (loop thread only)."""

    def __init__(self, calls: CallTable, send_call: Callable[[m.ActorCall], None],
                 is_alive: Callable[[int], bool]):
        self._calls = calls
        self._send_call = send_call
        self._is_alive = is_alive
        self._owned: dict[str, m.OwnActors] = {}  # by the owned mesh's spawn key
        self._told: set[tuple[str, int]] = set()  # (owned key, rank): each failure goes up once
        self._dead: dict[tuple[str, int], str] = {}  # (mesh, rank) -> why: deaths since that mesh (re)started

    def own(self, msg: m.OwnActors) -> None:
        """An actor owns actor mesh `msg.key` now (a spawn of the same name by the same owner, the same actor
        on the same rank, replaces the earlier one, as the spawn itself does on the ranks)."""
        for key, owned in list(self._owned.items()):
            if (owned.owner_key == msg.owner_key and owned.owner_rank == msg.owner_rank and owned.name == msg.name
                    and owned.mesh == msg.mesh and set(owned.ranks) & set(msg.ranks)):
                del self._owned[key]
        self._owned[msg.key] = msg
        for rank in msg.ranks:  # (a rank that died after it answered the spawn, before this message came)
            why = self._dead.get((msg.mesh, rank))
            if why is not None and (msg.mesh or rank != msg.owner_rank) and (msg.key, rank) not in self._told:
                self._told.add((msg.key, rank))
                self._tell(msg, self._death(msg, rank, why))

    def rank_died(self, rank: int, why: str, mesh: str = "") -> None:
        """Tell the owner of every owned mesh with an actor on `rank` (once per mesh and rank); `mesh`: a rank
        of another mesh of the notebook died (actors here may own actors there)."""
        self._dead[(mesh, rank)] = why
        for owned in list(self._owned.values()):
            if owned.mesh != mesh or (not mesh and owned.owner_rank == rank):
                continue
            if rank in owned.ranks and (owned.key, rank) not in self._told:
                self._told.add((owned.key, rank))
                self._tell(owned, self._death(owned, rank, why))

    @staticmethod
    def _death(owned: m.OwnActors, rank: int, why: str) -> MeshFailure:
        actor = owned.origin.actor_name(owned.name, rank) if owned.origin is not None else ""
        return MeshFailure(owned.name, owned.class_name, rank, FailureKind.DIED, why, actor=actor)

    def mesh_restarted(self, mesh: str) -> None:
        """Another mesh of the notebook restarted or shut down: its ranks' deaths are past."""
        self._dead = {where: why for where, why in self._dead.items() if where[0] != mesh}

    def actor_failed(self, msg: m.ActorFailed, heard: Callable[[], None], mesh: str = "") -> bool:
        """An actor failed on its rank: tell the actor that owns its mesh (once per mesh and rank), then call
        heard(); False if no actor here owns it. `mesh`: the failed actor is another mesh's of the notebook."""
        owned = self._owned.get(msg.key)
        if owned is None or owned.mesh != mesh:
            return False
        if (msg.key, msg.rank) in self._told:
            heard()
        else:
            self._told.add((msg.key, msg.rank))
            self._tell(owned, msg.failure, heard)
        return True

    def broadcast_failed(self, msg: m.BroadcastFailed) -> None:
        """A broadcast sent by an actor failed: ask the sender, as an owner is asked (and up from there)."""
        sender = m.OwnActors(msg.sender_rank, msg.sender_key, msg.sender_label, "", "", "", ())
        self._tell(sender, msg.failure)

    def forget(self) -> None:
        """The ranks were replaced: what they owned is gone."""
        self._owned.clear()
        self._told.clear()
        self._dead.clear()

    def _tell(self, owned: m.OwnActors, failure: MeshFailure, heard: Callable[[], None] | None = None) -> None:
        """Ask the owner's `__supervise__`; `heard` is called once it answered (or could not be asked)."""
        if not self._is_alive(owned.owner_rank):
            if heard is not None:
                heard()
            self._pass_on(owned, failure.passed_over(f"{owned.owner_label} (its rank is gone)"))
            return
        pending = self._calls.new((owned.owner_rank,), f"{owned.owner_label}.{SUPERVISE}")
        pending.actor = owned.owner_key

        def answered(reply: m.ActorReply) -> None:
            if heard is not None:
                heard()
            f = reply.failure
            if f is None:
                if reply.value is not None and unseal(reply.value):
                    return  # handled
                self._not_handled(owned, failure.passed_over(owned.owner_label))
            elif f.cause is m.FailureCause.NO_SUCH_ENDPOINT:  # it has no __supervise__
                self._not_handled(owned, failure.passed_over(f"{owned.owner_label} (no {SUPERVISE})"))
            else:  # __supervise__ raised (or its rank died meanwhile): a new failure, caused by this one
                self._not_handled(owned, MeshFailure(owned.owner_key.split("#")[0], owned.owner_label,
                                                     owned.owner_rank, FailureKind.EXCEPTION,
                                                     f"{SUPERVISE} raised {f.message}", f.traceback, failure))

        pending.on_reply = answered
        self._send_call(m.ActorCall(m.CONTROLLER, pending.call_id, owned.owner_key, SUPERVISE,
                                    seal(((failure,), {})), (owned.owner_rank,)))

    def _not_handled(self, owned: m.OwnActors, failure: MeshFailure) -> None:
        """The owner did not handle a failure of what it owns: it fails too, as in Monarch (its running and later
        calls say so), and the failure goes on up. (A broadcast's sender, asked as an owner is, does not fail.)"""
        if owned.key:
            pending = self._calls.new((owned.owner_rank,), f"{owned.owner_label} fails")
            pending.actor = SYSTEM_ACTOR
            self._send_call(m.ActorCall(m.CONTROLLER, pending.call_id, SYSTEM_ACTOR, "operate",
                                        seal(((FailActor(owned.owner_key, failure.report()),), {})),
                                        (owned.owner_rank,)))
        self._pass_on(owned, failure)

    def _pass_on(self, owned: m.OwnActors, failure: MeshFailure) -> None:
        """To the owner's owner, or to the notebook's hook (on its own thread: it runs user code)."""
        parent = self._owned.get(owned.owner_key)
        if parent is not None:
            self._tell(parent, failure)
        else:
            threading.Thread(target=report_unhandled, args=(failure,), name="mesh-supervision", daemon=True).start()
