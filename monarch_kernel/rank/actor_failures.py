"""Actors that fail on a rank, as in Monarch.

An endpoint's exception normally goes to its caller and the actor serves on. What ends the actor instead
(`ends_the_actor`): a BaseException that is no Exception (a stop aside), or any exception of an endpoint
that answers through its own port (there was nobody to raise it to). A failed actor:
- answers the call that failed it, every call queued behind it and every later one with its failure;
- its owner hears of it first (`ActorFailed` to the controller, which routes it to the owner's
  `__supervise__` or the fault hook); the failing call is answered once the owner heard, or after
  OWNER_HEARS_S, so a caller never sees the failure before the owner could act on it;
- is ended on a thread of its own (what it owns is stopped, then its `__cleanup__(exc)` runs), as this
  may be the loop thread its clean-up needs.
The controller may also fail an actor (`fail_key`): a failure of an actor mesh it owns was not handled;
its running calls are stopped and answered with the report.
A process where an actor failed (a constructor too) takes no new actors from Monarch's `ProcMesh.spawn`
from then on (`first`, latched: Monarch's poisoned process); its other actors serve on.

`rank/actor_host.py` serves the calls and hands what they raised to `ActorFailures`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.actors.base import SYSTEM_ACTOR
from monarch_kernel.actors.identities import identity_of
from monarch_kernel.actors.ports import Channel, Port, PortReceiver
from monarch_kernel.core.errors import SupervisionError
from monarch_kernel.core.failures import FailureKind
from monarch_kernel.core.future import Future
from monarch_kernel.core.supervision import SUPERVISE, MeshFailure
from monarch_kernel.rank.call_replies import CallReplies
from monarch_kernel.rank.mailbox import Mailbox, Mailboxes
from monarch_kernel.rank.rank_sender import RankSender
from monarch_kernel.rank.runs import Runs
from monarch_kernel.wire.calls import CallKey
from monarch_kernel.wire.messages import ActorCall, ActorFailed, Failure, FailureCause

OWNER_HEARS_S = 5.0  # how long the answer to a call that failed its actor waits for the owner to hear of it


class ActorFailures:
    """What happens on a rank when one of its actors fails (see the module's note)."""

    def __init__(self, rank: int, lock: threading.Lock, mailboxes: Mailboxes, replies: CallReplies,
                 sender: RankSender, runs: Runs, stop_runs: Callable[[list[CallKey]], None],
                 end: Callable[[Mailbox, BaseException | None], None]):
        self.rank = rank
        self._lock = lock  # the actor host's: guards the mailboxes' state (`failed`, `stopped`, `queue`)
        self._mailboxes = mailboxes
        self._replies = replies
        self._sender = sender
        self._runs = runs
        self._stop_runs = stop_runs  # stop these calls wherever they run (the actor host's)
        self._end = end  # end a failed actor: what it owns, then its instance (the actor host's)
        self.first = ""  # the first actor failure on this process ("": none); latched, as Monarch's poisoned process

    @staticmethod
    def ends_the_actor(box: Mailbox, msg: ActorCall, exc: BaseException, failure: Failure) -> bool:
        """Whether what an endpoint raised ends its actor, as in Monarch: a BaseException that is no Exception
        (an interrupt aside: a stop), or any exception of an endpoint that answers through its own port (it had
        nobody to raise it to). Other exceptions go to the caller, and the actor serves on."""
        if failure.interrupted or isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError)):
            return False
        if box.key == SYSTEM_ACTOR or msg.endpoint == SUPERVISE:  # (the controller handles a failing __supervise__)
            return False
        return not isinstance(exc, Exception) or bool(box.endpoints[msg.endpoint][3])

    def fail(self, box: Mailbox, msg: ActorCall, exc: BaseException,
             failure: Failure) -> tuple[Failure, Future[Any] | None]:
        """The actor of `box` failed: it answers this call and every later one with that (its queued calls
        too), its owner hears of it (`ActorFailed`), and what it owns is stopped before its `__cleanup__(exc)`
        runs (on a thread of its own: this may be the loop its clean-up needs). The answer to this call, and
        what says that the owner heard of it (None: the actor had failed already)."""
        cls = type(box.instance).__name__
        said = failure.message  # (the exception's type, and what it said)
        failed = Failure(failure.error_type, f"actor {box.name!r} ({cls}) on rank {self.rank} failed: its endpoint "
                         f"{msg.endpoint} raised {said}", failure.traceback, cause=FailureCause.ACTOR_FAILED)
        if not self.mark_failed(box, failed, exc):
            return box.failed or failed, None
        identity = identity_of(box.key)
        port: Port[Any]
        receiver: PortReceiver[Any]
        port, receiver = Channel.open(once=True)
        self._sender.send_up(ActorFailed(self.rank, box.key, MeshFailure(
            box.name, cls, self.rank, FailureKind.EXCEPTION, f"endpoint {msg.endpoint} raised {said}",
            failure.traceback, actor=identity.qualified_name() if identity is not None else ""),
            (port._owner, port._port_id)))
        return failed, receiver.recv()

    def fail_key(self, key: str, report: str) -> bool:
        """The actor of spawn `key` here fails: a failure of an actor mesh it owns was not handled (the controller
        asks, `FailActor`). Its running calls stop and, as every later one, are answered with `report`; its
        owner has heard already. Whether it was here."""
        box = self._mailboxes.get(key)
        if box is None or box.key == SYSTEM_ACTOR:
            return False
        failed = Failure("SupervisionError", report, "", cause=FailureCause.ACTOR_FAILED)
        if self.mark_failed(box, failed, SupervisionError(report, [])):
            self._stop_runs([run.key for run in self._runs.calls() if run.actor is box and isinstance(run.key, tuple)])
        return True

    def mark_failed(self, box: Mailbox, failed: Failure, error: BaseException) -> bool:
        """Mark `box` failed with `failed` (False: it had failed or stopped already): its queued calls are
        answered with it, and it is ended on a thread of its own."""
        queued: list[ActorCall] = []
        with self._lock:
            if box.failed is not None or box.stopped:
                return False
            box.failed = failed
            queued.extend(box.queue)
            box.queue.clear()
        self.note(failed)
        for call in queued:
            self._replies.reply(call, None, failed)
        threading.Thread(target=self._end, args=(box, error), name=f"actor-failed-{box.name}",
                         daemon=True).start()
        return True

    def note(self, failed: Failure) -> None:
        """An actor of this process failed (its constructor or later): from now on, as in Monarch, the process takes
        no new actors from ProcMesh.spawn (`SpawnRefused`); the first failure is the one named."""
        if not self.first:
            self.first = failed.message.splitlines()[0] if failed.message else failed.error_type

    def answer(self, box: Mailbox, msg: ActorCall, value: Any, failure: Failure | None, seconds: float,
               heard: Future[Any] | None) -> None:
        """Answer a call; one that failed its actor (`heard`: what says its owner heard of it) once its owner
        heard, at most OWNER_HEARS_S later, on a thread of its own."""
        if heard is None:
            self._replies.answer(box, msg, value, failure, seconds)
            return

        def when_heard() -> None:
            with contextlib.suppress(Exception):  # (not heard in time: answered all the same)
                heard.get(timeout=OWNER_HEARS_S)
            self._replies.answer(box, msg, value, failure, seconds)

        threading.Thread(target=when_heard, name=f"actor-failed-answer-{box.name}", daemon=True).start()
