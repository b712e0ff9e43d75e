"""Requests in flight (cells, pushes, pulls, calls of functions) and what ranks report of them.

`RequestBook` sends a request to its ranks, books each rank's result or failure as they
come, turns rank deaths and silences into failures and notices, and completes the request
when no rank is left outstanding. A request to ranks on this machine goes on their direct
lanes from the caller's thread, and its output and results come back on them to whichever
thread reads the lanes (usually the one waiting for it); others go host by host through the
agents, from the controller's loop thread. One lock guards the bookkeeping, so either
thread may book and complete a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from monarch_kernel.controller.events import DoneEvent, NoticeEvent, RanksDoneEvent
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.router import ControllerSender
from monarch_kernel.controller.state import MeshState, RankState, Request
from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.core.failures import FailureKind, RankFailure
from monarch_kernel.core.ids import fresh_ids
from monarch_kernel.core.interrupt_shield import shielded
from monarch_kernel.core.output_caps import fd_dropped_note, fit
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.diagnosis import CollectivesAborted
from monarch_kernel.wire.lane_client import Lane
from monarch_kernel.wire.transport import encode

HELD_AT_MOST_S = 2.0  # a result waits at most this long for the fd output it says came before it
INPUT_UNCLAIMED_S = 60.0  # an input() that no waiting thread takes to the notebook fails after this


class IdleOutput(Protocol):
    """Where ranks' text printed outside any request goes (the notebook's `api.sinks.IdleOutput`)."""

    def write(self, rank: int, stream: str, text: str) -> None:
        """Text `rank` printed on `stream`, outside any request."""

    def flush(self) -> None:
        """Show what is held back now (the mesh is shutting down)."""


class DiscardedOutput:
    """An IdleOutput that shows nothing (a mesh started without one)."""

    def write(self, rank: int, stream: str, text: str) -> None:
        """Dropped (it is in the rank's log)."""

    def flush(self) -> None:
        """Nothing is held."""


class RequestBook:
    """The requests of one mesh, from submission to completion."""

    _req_ids = fresh_ids()

    def __init__(self, state: MeshState, loop: ControllerLoop, sender: ControllerSender, idle_output: IdleOutput):
        self._state = state
        self._loop = loop
        self._sender = sender
        self._idle_output = idle_output
        self._lock = threading.RLock()  # the requests, their results and the ranks' inflight lists
        sender.on_request_message = self._from_lane

    # ------------------------------------------------------------ from any thread
    def submit(self, ranks: Iterable[int], make_body: Callable[[int], Any], *, label: str,
               fail_fast: bool = False, on_done: Callable[[], None] | None = None) -> Request:
        """Send a request (body built from its req_id) to ranks."""
        self._state.require_open()
        req = Request(next(self._req_ids), frozenset(ranks), label, fail_fast, on_done=on_done)
        body = make_body(req.req_id)
        lanes = self._sender.request_lanes(req.ranks)
        if lanes is not None:
            for lane, rank in zip(lanes, sorted(req.ranks)):
                lane.check_room(rank)  # a rank that reads nothing: fail fast, before anything is booked or sent
            req.on_lanes = True
            chunks = encode(body)
        try:  # a stop never sends it to some ranks only; one that came as it was sent is raised after
            if lanes is None:
                shielded(lambda: self._loop.call(self._send, req, body))
            else:
                shielded(lambda: self._send_on_lanes(req, lanes, chunks))
        except KeyboardInterrupt:  # it went out whole, and nobody will wait on it: stop it on the ranks too
            self.stop(req)
            raise
        return req

    def _send_on_lanes(self, req: Request, lanes: list[Lane], chunks: list[Any]) -> None:
        with self._lock:
            self._book(req)
        for lane in lanes:
            try:
                self._sender.lanes.send(lane, chunks)
            except ConnectionClosed:
                pass  # the rank is going away: its agent reports how
        with self._lock:
            self._maybe_complete(req)

    def adopt(self, req_id: int, label: str, running: Iterable[int], results: dict[int, m.Result]) -> Request:
        """Follow a request an earlier kernel sent (a persistent mesh just attached): it still runs on `running`,
        and ended with `results` elsewhere. Its output and results from now on come to it, through the agents
        (its lanes went with that kernel). Called again for another host's ranks of it, it grows."""
        with self._lock:
            req = self._state.requests.get(req_id)
            if req is None:
                req = Request(req_id, frozenset(), label, False)
            fresh = Request(req_id, frozenset(running), label, False)
            req.ranks = req.ranks | fresh.ranks | frozenset(results)
            req.results.update(results)
            self._book(fresh)  # (the running ranks' inflight lists)
            self._state.requests[req_id] = req
            self._maybe_complete(req)
        return req

    def send_input(self, ranks: Iterable[int], req_id: int, text: str, error: str | None = None) -> None:
        """Answer the input() of these ranks in a request (error: why there is no answer)."""
        self._loop.call(self._state.send_to_ranks, frozenset(ranks),
                        lambda local: m.InputReply(local, req_id, text, error))

    def interrupt(self, ranks: Iterable[int]) -> None:
        """KeyboardInterrupt in whatever these ranks run (cells, endpoints), and in the requests
        they were sent that have not started yet (the stop button)."""
        self._loop.call(self._interrupt, frozenset(ranks))

    def in_flight(self, ranks: Iterable[int]) -> list[Request]:
        """The requests that these ranks are running or were sent and have not answered."""
        with self._lock:
            ids = {req_id for rank in ranks if rank in self._state.ranks for req_id in self._state.ranks[rank].inflight}
            return [self._state.requests[i] for i in sorted(ids) if i in self._state.requests]

    def stop(self, req: Request) -> None:
        """Stop one request on the ranks that still owe it, whether it started there or not."""
        self._loop.call(self._stop, req, False)

    def _from_lane(self, msg: Any) -> None:
        """A request's output or result that came on a lane (on the thread reading it)."""
        if isinstance(msg, m.Result):
            with self._lock:
                req = self._state.requests.get(msg.req_id)
                if req is None or msg.rank not in req.ranks:  # (booked requests are not done)
                    return
                if not self._fd_caught_up(msg):  # fd output it says came before it is still on its way
                    req.held[msg.rank] = (msg, time.monotonic())
                    return
                req.results[msg.rank] = msg
                self._maybe_complete(req)
        elif isinstance(msg, m.Output):
            self.output(msg)
        elif isinstance(msg, m.Display):
            self.display(msg)
        elif isinstance(msg, CollectivesAborted):
            self.collectives_aborted(msg)
        elif isinstance(msg, m.InputRequest):
            link = self._state.link_of(msg.rank)
            if link is not None:  # (the answer goes through the agent, to the rank's reader thread)
                self._loop.call(self.input_request, link.send, msg)

    def collectives_aborted(self, msg: CollectivesAborted) -> None:
        """A stop ended collectives on a rank (any thread): its request notes it, for a fresh group after."""
        with self._lock:
            req = self._state.requests.get(msg.req_id)
            if req is not None:
                req.aborted[msg.rank] = msg.what

    def release_overdue(self, req: Request, after: float = HELD_AT_MOST_S) -> None:
        """Book results held longer than `after` for fd output that has not come (a safety net)."""
        if req.held:
            with self._lock:
                now = time.monotonic()
                self._release(req, [rank for rank, (_, since) in req.held.items() if now - since > after])

    def _fd_caught_up(self, result: m.Result) -> bool:
        """Whether the fd output a result says came before it has all reached us."""
        return result.fd_mark <= self._state.ranks[result.rank].fd_seen

    def _release(self, req: Request, ranks: Iterable[int]) -> None:
        """Book these ranks' held results (the waiter shows them done when it next wakes: see
        futures.py). Caller holds the lock."""
        for rank in ranks:
            result, _ = req.held.pop(rank)
            if not req.done:
                req.results[rank] = result
        self._maybe_complete(req)

    # ------------------------------------------------------------ on the loop thread
    def _interrupt(self, ranks: frozenset[int]) -> None:
        with self._lock:
            inflight = {rank: tuple(self._state.ranks[rank].inflight) for rank in ranks if rank in self._state.ranks}
            for req_id in {req_id for ids in inflight.values() for req_id in ids}:
                if (req := self._state.requests.get(req_id)) is not None:
                    req.stopping = True
        for link, local in self._state.by_link(ranks):
            req_ids = sorted({req_id for rank in local for req_id in inflight.get(rank, ())})
            link.send(m.InterruptRanks(local, tuple(req_ids), running=True))

    def _stop(self, req: Request, once: bool) -> None:
        if req.done or (once and req.stopping):
            return  # (once: a lost host's ranks each fail the request; a user's second stop is sent)
        req.stopping = True
        self._state.send_to_ranks(req.outstanding, lambda local: m.InterruptRanks(local, (req.req_id,)))

    def _send(self, req: Request, body: Any) -> None:
        with self._lock:
            alive = self._book(req)
        self._state.send_work(alive, body)
        with self._lock:
            self._maybe_complete(req)

    def _book(self, req: Request) -> list[int]:
        """Enter a request in the book and its live ranks' inflight lists; returns those ranks
        (the dead ones have failed it already). Caller holds the lock."""
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
        return alive

    def _maybe_complete(self, req: Request) -> None:
        """Complete the request if no rank owes it anything. Caller holds the lock."""
        if len(req.results) + len(req.failures) < len(req.ranks) or req.outstanding or req.done:
            return
        state = self._state
        state.requests.pop(req.req_id, None)
        now = time.time()
        for rank in req.ranks:
            rank_state = state.ranks[rank]
            if req.req_id in rank_state.inflight:
                rank_state.inflight.remove(req.req_id)
                rank_state.busy_since = now if rank_state.inflight else None
        times = []
        for rank in sorted(req.ranks):
            result = req.results.get(rank)
            times.append(RankTiming(rank, None, False) if result is None
                         else RankTiming(rank, result.finished - result.started, result.failure is None))
        req.timings = times
        state.record_timing(req.label, times, now)
        if req.on_done is not None:
            req.on_done()
        for rank, dropped in sorted(req.fd_dropped.items()):
            req.events.put(m.Output(rank, req.req_id, "stderr", fd_dropped_note(rank, dropped)))
        req.events.put(DoneEvent())
        req.finish()

    def fail_all(self, why: str) -> None:
        """The mesh restarts or shuts down: every request and call in flight fails."""
        self._sender.fail_all(why)
        with self._lock:
            for req in list(self._state.requests.values()):
                for rank in req.outstanding:
                    host = self._state.ranks[rank].host
                    req.failures[rank] = RankFailure(rank, host, FailureKind.LOST, "MeshRestarted", why)
                self._maybe_complete(req)

    # ------------------------------------------------------------ what agents report
    def gathered(self, msg: m.Gathered) -> None:
        """Results of one request from the ranks of one host."""
        with self._lock:
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
        with self._lock:
            rank_state = self._state.ranks[msg.rank]
            taken = not msg.text or self._to_request(msg)
            if msg.text:
                rank_state.log.write(msg.stream, msg.text)
            if msg.fd_total is not None and msg.fd_total > rank_state.fd_seen:
                rank_state.fd_seen = msg.fd_total
                for req_id in list(rank_state.inflight):  # results that waited for this output
                    req = self._state.requests.get(req_id)
                    if req is not None and msg.rank in req.held:
                        self._release(req, [rank for rank in list(req.held) if self._fd_caught_up(req.held[rank][0])])
        if not taken:
            self._idle_output.write(msg.rank, msg.stream, msg.text)

    def display(self, msg: m.Display) -> None:
        """A rich display made on a rank."""
        with self._lock:
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
        if isinstance(msg, m.Output) and msg.req_id is None:  # fd output (the agent caps it for remote hosts)
            text, dropped = fit(msg.text, req.fd_shown.get(msg.rank, 0))
            if dropped:
                req.fd_dropped[msg.rank] = req.fd_dropped.get(msg.rank, 0) + dropped
                if not text:
                    return True
                msg = dataclasses.replace(msg, text=text)
            req.fd_shown[msg.rank] = req.fd_shown.get(msg.rank, 0) + len(text)
        req.events.put(msg)
        return True

    def rank_exited(self, rank: int, exit_code: int | None, signal_name: str | None, stderr_tail: tuple[str, ...],
                    *, expected: bool, host_lost: bool = False, cause: str = "") -> None:
        """A rank's process ended: fail what it was running, and the calls it owed."""
        with self._lock:
            self._rank_exited(rank, exit_code, signal_name, stderr_tail, expected, host_lost, cause)

    def _rank_exited(self, rank: int, exit_code: int | None, signal_name: str | None,
                     stderr_tail: tuple[str, ...], expected: bool, host_lost: bool, cause: str) -> None:
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
            if req is not None and rank in req.held:  # it answered: its fd output will not come now
                self._release(req, [rank])
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
        with self._lock:
            for req_id in rank_state.inflight:
                req = self._state.requests.get(req_id)
                if req is not None:
                    req.events.put(NoticeEvent(msg.rank, note))
