"""MeshFuture: the result of work on the mesh, to `.get(timeout)` or `await`.

While a caller waits, the future pumps the request's live events into its output sink
on the caller's own thread, so output lands in the cell that is waiting. Ctrl-C (the
notebook's stop button) interrupts the ranks, waits briefly for their tracebacks and
raises MeshInterrupted; a timeout does the same and raises MeshTimeoutError.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from monarch_kernel.api.hangs import HangWatch, remake_groups_after_stop
from monarch_kernel.controller import events as ev
from monarch_kernel.core.errors import raise_for
from monarch_kernel.core.failures import FailureKind, RankFailure
from monarch_kernel.core.future import INTERRUPT_GRACE_S, Future
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.timing import RankTiming
from monarch_kernel.wire import messages as m

if TYPE_CHECKING:
    from monarch_kernel.api.sinks import OutputSink
    from monarch_kernel.controller.runtime import MeshRuntime
    from monarch_kernel.controller.state import Request

T = TypeVar("T")
PUMP_INTERVAL_S = 0.05
INPUT_GATHER_S = 0.2  # ranks asking for input within this share one question


class MeshFuture(Future[T]):
    """Work in flight on some ranks. `get()` blocks (interruptibly); `await` works too."""

    def __init__(self, runtime: MeshRuntime, request: Request, sink: OutputSink,
                 finish: Callable[[Request], T], *, timeout: float | None = None):
        super().__init__(timeout)
        self._runtime = runtime
        self._request = request
        self._sink = sink
        self._make_result = finish
        self._created = time.monotonic()
        self._background = False
        self._stopping = False
        self._marked_done: set[int] = set()  # ranks shown done (requests on lanes)
        self._watch = HangWatch(runtime, tuple(request.ranks), lambda: request.done, request.label,
                                runtime.inspections.hang_after_s)

    @property
    def label(self) -> str:
        """What this future runs (e.g. the cell name)."""
        return self._request.label

    def done(self) -> bool:
        """Whether every rank has answered (or failed)."""
        return self._request.done

    def rank_times(self) -> list[RankTiming]:
        """(rank, seconds, ok) for each rank of a finished run; seconds None if it died."""
        return list(self._request.timings)

    def pump_in_background(self) -> None:
        """Deliver live output from a daemon thread (for runs nobody waits on)."""
        self._background = True
        threading.Thread(target=self._bg_wait, name=f"mesh-pump-{self.label}", daemon=True).start()

    def _bg_wait(self) -> None:
        try:
            self.get()
        except BaseException:  # noqa: BLE001 - kept in the outcome for whoever asks
            pass

    # ------------------------------------------------------------ Future
    def _wait(self, timeout: float | None) -> bool:
        """Dispatch events until done (True) or the timeout passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        events = self._request.events
        while True:
            wait = PUMP_INTERVAL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return False
            if self._request.on_lanes and events.empty() and not self._request.done:
                # its output and results come on the ranks' lanes: read them on this thread
                wait = 0.0 if self._read_lanes(events, wait) else wait
            try:
                event = events.get(timeout=wait) if wait > 0 else events.get_nowait()
            except queue.Empty:
                if self._request.on_lanes:
                    self._mark_ranks_done()
                    self._runtime.requests.release_overdue(self._request)
                self._sink.tick()
                self._watch.tick(self._show_verdict)
                continue
            if isinstance(event, ev.DoneEvent):
                return True
            if isinstance(event, m.InputRequest):
                self._answer_input(event)
            else:
                self._dispatch(event)

    def _mark_ranks_done(self) -> None:
        """Show which ranks have finished a request sent on lanes (its results queue no event:
        a fast request then wakes its waiter once, not once per rank)."""
        # (a snapshot: the loop thread's service tick books results into the dict while this thread looks;
        # iterating it directly once failed a plan.apply with 'dictionary changed size during iteration')
        for rank in [r for r in tuple(self._request.results) if r not in self._marked_done]:
            self._marked_done.add(rank)
            self._sink.rank_done(rank)

    def _read_lanes(self, events: queue.SimpleQueue, wait: float) -> bool:
        """Read the request's lanes until an event is queued (True) or `wait` passes; False when
        some lane is closed (a rank going away: its death comes through the agent)."""
        sender = self._runtime.sender
        sender.flush_calls()
        done = sender.lanes.wait(tuple(sorted(self._request.ranks)), lambda: not events.empty(), wait)
        return done is not None

    async def _wait_async(self) -> None:
        await asyncio.wrap_future(self._request.completion())

    def _cancel(self) -> None:
        self._stopping = True
        self._runtime.requests.stop(self._request)

    def _unwinding(self) -> bool:
        req = self._request  # (`aborted` is booked by the loop thread: read a copy)
        return bool(set(tuple(req.aborted)) & req.outstanding)

    def _finish(self) -> T:
        self._sink.close()
        # stopped by someone else (%mesh interrupt, the sidebar) inside collectives: nobody else makes the
        # group anew for a run this future did not stop itself (`_stopped` does it for its own stops)
        remade = remake_groups_after_stop(self._runtime, self._request)
        if remade is not None:
            print(f"monarch_kernel: {remade}", file=sys.stderr, flush=True)
        return self._make_result(self._request)

    def _show_verdict(self, text: str, html: str) -> None:
        """A hang seen while waiting: the sink's own block for it where it has one, else a notice."""
        verdict = getattr(self._sink, "verdict", None)  # optional in OutputSink, like new_block
        if verdict is not None:
            verdict(text, html)
        else:
            self._sink.notice(min(self._request.ranks), text)

    def _stopped(self, why: str, error_type: type[BaseException]) -> BaseException:
        req = self._request
        self._sink.close()
        remade = remake_groups_after_stop(self._runtime, req)
        if remade is not None:
            print(f"monarch_kernel: {remade}", file=sys.stderr, flush=True)
        failures = collect_failures(req, self._runtime)
        still = sorted(req.outstanding)
        for rank in still:
            failures.append(RankFailure(
                rank, self._runtime.state.host_of(rank), FailureKind.INTERRUPTED, "StillRunning",
                f"rank {rank} did not stop within {INTERRUPT_GRACE_S:g} s (it may be inside native "
                "code such as a collective); interrupt again, or %mesh restart"))
        summary = f"{req.label} {why} on ranks {format_ranks(req.ranks)}"
        if still:
            summary += f"; ranks {format_ranks(still)} are still busy"
        return error_type(summary, failures)

    # ------------------------------------------------------------ events
    def _dispatch(self, event: ev.RequestEvent) -> None:
        match event:
            case m.Output(rank=rank, stream=stream, text=text):
                self._sink.output(rank, stream, text)
            case m.Display(rank=rank, data=data, metadata=metadata):
                self._sink.display(rank, data, metadata)
            case ev.NoticeEvent(rank=rank, text=text):
                self._sink.notice(rank, text)
            case ev.RanksDoneEvent(ranks=ranks):
                for rank in ranks:
                    self._sink.rank_done(rank)

    def _answer_input(self, first: m.InputRequest) -> None:
        """Ranks called input() (or pdb, or getpass): ask the notebook, once per distinct prompt.

        SPMD code asks on every rank at about the same moment: requests that come within
        INPUT_GATHER_S with the same prompt share one question, and its answer goes to
        all of them (e.g. one `(Pdb)` box drives the debugger on every rank).
        """
        asking = {first.rank: (first.prompt, first.password)} if self._request.claim_input(first) else {}
        events, deadline = self._request.events, time.monotonic() + INPUT_GATHER_S
        while len(asking) < len(self._request.ranks) and (left := deadline - time.monotonic()) > 0:
            try:
                event = events.get(timeout=left)
            except queue.Empty:
                break
            if isinstance(event, m.InputRequest):
                if self._request.claim_input(event):  # else: it waited too long and was answered
                    asking[event.rank] = (event.prompt, event.password)
            elif isinstance(event, ev.DoneEvent):
                events.put(event)
                break
            else:
                self._dispatch(event)
        prompts: dict[tuple[str, bool], list[int]] = {}
        for rank, question in sorted(asking.items()):
            prompts.setdefault(question, []).append(rank)
        for (prompt, password), ranks in prompts.items():
            new_block = getattr(self._sink, "new_block", None)  # optional in OutputSink
            if new_block is not None:
                new_block()  # what came before stays above the question, what follows goes below
            who = f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"
            if password:  # a program on the hosts asks: say so, so it cannot pass for the notebook's own box
                who += f" of mesh {self._runtime.name!r}; what you type goes to those ranks"
            try:
                text, error = self._read_line(f"[{who}] {prompt}", password), None
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - the ranks hear why, and the cell goes on
                text, error = "", f"the notebook could not read a line ({type(exc).__name__}: {exc})"
            self._runtime.requests.send_input(ranks, self._request.req_id, text, error)

    def _read_line(self, prompt: str, password: bool) -> str:
        if self._background:
            raise RuntimeError("background runs (--bg) cannot ask for input")
        if self._stopping:
            raise RuntimeError("the run is being stopped")
        if password:
            import getpass

            return getpass.getpass(prompt)  # the notebook shows a masked box (ipykernel's getpass)
        return input(prompt)

    def __repr__(self) -> str:
        state = "done" if self.done() else f"running for {time.monotonic() - self._created:.1f} s"
        return f"<MeshFuture {self.label} on ranks {format_ranks(self._request.ranks)}: {state}>"


def collect_failures(req: Request, runtime: MeshRuntime) -> list[RankFailure]:
    """Every failure of a finished (or stopped) request, one per rank, sorted by rank."""
    failures = dict(req.failures)
    for rank, result in req.results.items():
        f = result.failure
        if f is None:
            continue
        state = runtime.ranks[rank]
        failures[rank] = RankFailure(rank, state.host, failure_kind(req, rank, f), f.error_type, f.message,
                                     f.traceback, pid=state.pid)
    return [failures[r] for r in sorted(failures)]


def failure_kind(req: Request, rank: int, failure: m.Failure) -> FailureKind:
    """Interrupted (a KeyboardInterrupt; or, in a request that was being stopped, a collective that a stop
    ended: a peer's stop may break a rank's collective before its own stop comes) or an exception."""
    stopped = failure.interrupted or (req.stopping and rank in req.aborted)
    return FailureKind.INTERRUPTED if stopped else FailureKind.EXCEPTION


def raise_failures(req: Request, runtime: MeshRuntime, partial: object = None) -> None:
    """Raise RemoteError if any rank failed the request."""
    failures = collect_failures(req, runtime)
    if not failures:
        return
    kinds = sorted({f.error_type for f in failures})
    summary = (f"{req.label} failed on {len(failures)} of {len(req.ranks)} ranks "
               f"({format_ranks([f.rank for f in failures])}): {', '.join(kinds)}")
    raise_for(failures, summary, partial)
