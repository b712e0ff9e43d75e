"""Requests in flight (cells, pushes, pulls, calls of functions) and what ranks report of them.

`RequestBook` sends a request to its ranks host by host, books each rank's result or
failure as agents report them, turns rank deaths and silences into failures and notices,
and completes the request when no rank is left outstanding. It runs on the controller's
loop thread; `submit`, `send_input` and `interrupt` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from monarch_kernel.controller.events import DoneEvent, NoticeEvent, RanksDoneEvent
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.router import ControllerSender
from monarch_kernel.controller.state import MeshState, RankState, Request
from monarch_kernel.core.failures import FailureKind, RankFailure
from monarch_kernel.wire import messages as m

INPUT_UNCLAIMED_S = 60.0  # an input() that no waiting thread takes to the notebook fails after this
IdleOutput = Callable[[int, str, str], None]  # (rank, stream, text) printed outside any request


class RequestBook:
    """The requests of one mesh, from submission to completion."""

    _req_ids = itertools.count(1)

    def __init__(self, state: MeshState, loop: ControllerLoop, sender: ControllerSender, idle_output: IdleOutput):
        self._state = state
        self._loop = loop
        self._sender = sender
        self._idle_output = idle_output

    # ------------------------------------------------------------ from any thread
    def submit(self, ranks: Iterable[int], make_body: Callable[[int], Any], *, label: str,
               fail_fast: bool = False, on_done: Callable[[], None] | None = None) -> Request:
        """Send a request (body built from its req_id) to ranks."""
        self._state.require_open()
        req = Request(next(self._req_ids), frozenset(ranks), label, fail_fast, on_done=on_done)
        body = make_body(req.req_id)
        self._loop.call(self._send, req, body)
        return req

    def send_input(self, ranks: Iterable[int], req_id: int, text: str, error: str | None = None) -> None:
        """Answer the input() of these ranks in a request (error: why there is no answer)."""
        self._loop.call(self._state.send_to_ranks, frozenset(ranks),
                        lambda local: m.InputReply(local, req_id, text, error))

    def interrupt(self, ranks: Iterable[int]) -> None:
        """KeyboardInterrupt in whatever these ranks run (cells, endpoints), and in the requests
        they were sent that have not started yet (the stop button)."""
        self._loop.call(self._interrupt, frozenset(ranks))

    def stop(self, req: Request) -> None:
        """Stop one request on the ranks that still owe it, whether it started there or not."""
        self._loop.call(self._stop, req, False)

    # ------------------------------------------------------------ on the loop thread
    def _interrupt(self, ranks: frozenset[int]) -> None:
        for link, local in self._state.by_link(ranks):
            req_ids = sorted({req_id for rank in local for req_id in self._state.ranks[rank].inflight})
            link.send(m.InterruptRanks(local, tuple(req_ids), running=True))

    def _stop(self, req: Request, once: bool) -> None:
        if req.future.done() or (once and req.stopping):
            return  # (once: a lost host's ranks each fail the request; a user's second stop is sent)
        req.stopping = True
        self._state.send_to_ranks(req.outstanding, lambda local: m.InterruptRanks(local, (req.req_id,)))

    def _send(self, req: Request, body: Any) -> None:
        state = self._state
        state.requests[req.req_id] = req
        now = time.time()
        alive = []
        for rank in sorted(req.ranks):
            rank_state = state.ranks[rank]
            if not rank_state.alive:
                req.failures[rank] = state.death_failure(rank_state, "was already dead")
                continue
            if not rank_state.inflight:
                rank_state.busy_since = now
            rank_state.inflight.append(req.req_id)
            alive.append(rank)
        state.send_work(alive, body)
        self._maybe_complete(req)

    def _maybe_complete(self, req: Request) -> None:
        if req.outstanding or req.future.done():
            return
        state = self._state
        state.requests.pop(req.req_id, None)
        for rank in req.ranks:
            rank_state = state.ranks[rank]
            if req.req_id in rank_state.inflight:
                rank_state.inflight.remove(req.req_id)
                rank_state.busy_since = time.time() if rank_state.inflight else None
        times = []
        for rank in sorted(req.ranks):
            result = req.results.get(rank)
            times.append((rank, None, False) if result is None
                         else (rank, result.finished - result.started, result.failure is None))
        state.record_timing(req.label, times)
        if req.on_done is not None:
            req.on_done()
        req.events.put(DoneEvent())
        req.future.set_result(req)

    def fail_all(self, why: str) -> None:
        """The mesh restarts or shuts down: every request and call in flight fails."""
        self._sender.fail_all(why)
        for req in list(self._state.requests.values()):
            for rank in req.outstanding:
                host = self._state.ranks[rank].host
                req.failures[rank] = RankFailure(rank, host, FailureKind.LOST, "MeshRestarted", why)
            self._maybe_complete(req)

    # ------------------------------------------------------------ what agents report
    def gathered(self, msg: m.Gathered) -> None:
        """Results of one request from the ranks of one host."""
        req = self._state.requests.get(msg.req_id)
        if req is None:
            return
        for result in msg.results:
            req.results[result.rank] = result
        if req.outstanding:  # when all are done, DoneEvent says it (one wake-up, not two)
            req.events.put(RanksDoneEvent(tuple(r.rank for r in msg.results)))
        self._maybe_complete(req)

    def output(self, msg: m.Output) -> None:
        """Text a rank printed: to the request it belongs to, or shown as idle output."""
        self._state.ranks[msg.rank].log.write(msg.stream, msg.text)
        if not self._to_request(msg):
            self._idle_output(msg.rank, msg.stream, msg.text)

    def display(self, msg: m.Display) -> None:
        """A rich display made on a rank."""
        self._to_request(msg)

    def input_request(self, link_send: Callable[[Any], bool], msg: m.InputRequest) -> None:
        """A rank asks for a line: the waiting thread asks the notebook."""
        req = self._state.requests.get(msg.req_id)
        if req is None:
            link_send(m.InputReply((msg.rank,), msg.req_id, "", "its cell is no longer waiting"))
            return
        req.events.put(msg)

        def unclaimed() -> None:  # a run nobody waits on (run_async without get) cannot ask anyone
            if self._state.requests.get(msg.req_id) is req and req.expire_input(msg):
                link_send(m.InputReply((msg.rank,), msg.req_id, "", (
                    f"nothing asked the notebook within {INPUT_UNCLAIMED_S:g} s: no thread waits on this "
                    "run (run_async without .get()); call .get() on its future, or send the value with push")))

        asyncio.get_running_loop().call_later(INPUT_UNCLAIMED_S, unclaimed)

    def _to_request(self, msg: m.Output | m.Display) -> bool:
        """Hand a rank's output to the request it belongs to; False if it belongs to none."""
        req_id = msg.req_id
        inflight = self._state.ranks[msg.rank].inflight
        if req_id is None and inflight:
            req_id = inflight[0]  # fd-level output belongs to what the rank is running
        req = self._state.requests.get(req_id) if req_id is not None else None
        if req is None:
            return False
        req.events.put(msg)
        return True

    def rank_exited(self, rank: int, exit_code: int | None, signal_name: str | None, stderr_tail: tuple[str, ...],
                    *, expected: bool, host_lost: bool = False, cause: str = "") -> None:
        """A rank's process ended: fail what it was running, and the calls it owed."""
        rank_state = self._state.ranks[rank]
        rank_state.alive = False
        rank_state.exit_code, rank_state.signal, rank_state.host_lost = exit_code, signal_name, host_lost
        rank_state.cause = cause
        for line in stderr_tail:
            if ("stderr", line) not in rank_state.log:
                rank_state.log.append(("stderr", line))
        if expected:
            return
        failure = self._state.death_failure(rank_state, "died")
        self._sender.rank_died(rank, failure.message)
        if stderr_tail:
            failure = RankFailure(**{**failure.__dict__, "stderr_tail": stderr_tail})
        for req_id in list(rank_state.inflight):
            req = self._state.requests.get(req_id)
            if req is None or rank in req.results:
                continue
            req.failures[rank] = failure
            req.events.put(NoticeEvent(rank, failure.message))
            if req.fail_fast or host_lost:  # a lost host leaves the others waiting in collectives
                self._stop(req, once=True)
            self._maybe_complete(req)
        rank_state.inflight.clear()

    def health(self, msg: m.RankHealth) -> None:
        """A rank stopped (or resumed) answering heartbeats."""
        rank_state: RankState = self._state.ranks[msg.rank]
        rank_state.responsive = msg.responsive
        if msg.responsive:
            return
        note = (f"rank {msg.rank} (host {rank_state.host}, pid {rank_state.pid}) is not answering heartbeats; "
                "it may be stopped (SIGSTOP) or stuck in native code")
        for req_id in rank_state.inflight:
            req = self._state.requests.get(req_id)
            if req is not None:
                req.events.put(NoticeEvent(msg.rank, note))
