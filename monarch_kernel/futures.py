"""MeshFuture: the result of work on the mesh, to `.get(timeout)` or `await`.

While a caller waits, the future pumps the request's live events into its output sink
on the caller's own thread, so output lands in the cell that is waiting. Ctrl-C (the
notebook's stop button) interrupts the ranks, waits briefly for their tracebacks and
raises MeshInterrupted; a timeout does the same and raises MeshTimeoutError.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .errors import MeshInterrupted, MeshTimeoutError, RankDiedError, RankFailure, RemoteError
from .shape import format_ranks
from .sinks import OutputSink

if TYPE_CHECKING:
    from .controller import MeshRuntime
    from .runstate import Request

T = TypeVar("T")
INTERRUPT_GRACE_S = 0.8
PUMP_INTERVAL_S = 0.05
INPUT_GATHER_S = 0.2  # ranks asking for input within this share one question


class MeshFuture(Generic[T]):
    """Work in flight on some ranks. `get()` blocks (interruptibly); `await` works too."""

    def __init__(self, runtime: MeshRuntime, request: Request, sink: OutputSink,
                 finish: Callable[[Request], T], *, timeout: float | None = None):
        self._runtime = runtime
        self._request = request
        self._sink = sink
        self._finish = finish
        self._timeout = timeout
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None
        self._created = time.monotonic()
        self._background = False
        self._stopping = False

    @property
    def label(self) -> str:
        """What this future runs (e.g. the cell name)."""
        return self._request.label

    def done(self) -> bool:
        """Whether every rank has answered (or failed)."""
        return self._request.future.done()

    def get(self, timeout: float | None = None) -> T:
        """Wait for the result; raises RemoteError, MeshInterrupted or MeshTimeoutError."""
        with self._lock:
            if self._outcome is None:
                self._outcome = self._wait(timeout if timeout is not None else self._timeout)
        ok, value = self._outcome
        if ok:
            return value
        raise value

    def result(self, timeout: float | None = None) -> T:
        """Alias of get()."""
        return self.get(timeout)

    def __await__(self):
        return self._await().__await__()

    async def _await(self) -> T:
        await asyncio.wrap_future(self._request.future)
        return self.get()

    def rank_times(self) -> list[tuple[int, float | None, bool]]:
        """(rank, seconds, ok) for each rank of a finished run; seconds None if it died."""
        req = self._request
        out = []
        for rank in sorted(req.ranks):
            result = req.results.get(rank)
            if result is None:
                out.append((rank, None, False))
            else:
                out.append((rank, result.finished - result.started, result.failure is None))
        return out

    def pump_in_background(self) -> None:
        """Deliver live output from a daemon thread (for runs nobody waits on)."""
        self._background = True
        threading.Thread(target=self._bg_wait, name=f"mesh-pump-{self.label}", daemon=True).start()

    def _bg_wait(self) -> None:
        try:
            self.get()
        except BaseException:  # noqa: BLE001 - kept in the outcome for whoever asks
            pass

    # ------------------------------------------------------------ waiting
    def _wait(self, timeout: float | None) -> tuple[bool, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            finished = self._pump(deadline)
        except KeyboardInterrupt:
            return False, self._stop("interrupted", MeshInterrupted)
        if not finished:
            return False, self._stop(f"timed out after {timeout:g} s", MeshTimeoutError)
        self._sink.close()
        try:
            return True, self._finish(self._request)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by get()
            return False, exc

    def _pump(self, deadline: float | None) -> bool:
        """Dispatch events until done (True) or the deadline passes (False)."""
        events = self._request.events
        while True:
            wait = PUMP_INTERVAL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return False
            try:
                event = events.get(timeout=wait)
            except queue.Empty:
                self._sink.tick()
                continue
            if event[0] == "done":
                return True
            if event[0] == "input":
                self._answer_input(event)
                continue
            self._dispatch(event)

    def _dispatch(self, event: tuple) -> None:
        kind = event[0]
        if kind == "output":
            self._sink.output(event[1], event[2], event[3])
        elif kind == "display":
            self._sink.display(event[1], event[2], event[3])
        elif kind == "notice":
            self._sink.notice(event[1], event[2])
        elif kind == "ranks_done":
            for rank in event[1]:
                self._sink.rank_done(rank)

    def _answer_input(self, first: tuple) -> None:
        """Ranks called input() (or pdb, or getpass): ask the notebook, once per distinct prompt.

        SPMD code asks on every rank at about the same moment: requests that come within
        INPUT_GATHER_S with the same prompt share one question, and its answer goes to
        all of them (e.g. one `(Pdb)` box drives the debugger on every rank).
        """
        asking = {first[1]: first[2:]}  # rank -> (prompt, password)
        events, deadline = self._request.events, time.monotonic() + INPUT_GATHER_S
        while len(asking) < len(self._request.ranks) and (left := deadline - time.monotonic()) > 0:
            try:
                event = events.get(timeout=left)
            except queue.Empty:
                break
            if event[0] == "input":
                asking[event[1]] = event[2:]
            elif event[0] == "done":
                events.put(event)
                break
            else:
                self._dispatch(event)
        prompts: dict[tuple[str, bool], list[int]] = {}
        for rank, question in sorted(asking.items()):
            prompts.setdefault(question, []).append(rank)
        for (prompt, password), ranks in prompts.items():
            new_block = getattr(self._sink, "new_block", None)
            if new_block is not None:
                new_block()  # what came before stays above the question, what follows goes below
            try:
                text, error = self._read_line(f"[{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}] "
                                              f"{prompt}", password), None
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - the ranks hear why, and the cell goes on
                text, error = "", f"the notebook could not read a line ({type(exc).__name__}: {exc})"
            self._runtime.send_input(ranks, self._request.req_id, text, error)

    def _read_line(self, prompt: str, password: bool) -> str:
        if self._background:
            raise RuntimeError("background runs (--bg) cannot ask for input")
        if self._stopping:
            raise RuntimeError("the run is being stopped")
        if password:
            import getpass

            return getpass.getpass(prompt)  # the notebook shows a masked box (ipykernel's getpass)
        return input(prompt)

    def _stop(self, why: str, error_type: type) -> BaseException:
        """Interrupt the ranks still running, collect their tracebacks, build the error."""
        req = self._request
        self._stopping = True
        self._runtime.interrupt(req.outstanding)
        try:
            self._pump(time.monotonic() + INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: stop waiting for tracebacks
        self._sink.close()
        failures = collect_failures(req, self._runtime)
        still = sorted(req.outstanding)
        for rank in still:
            state = self._runtime.ranks[rank]
            failures.append(RankFailure(
                rank, state.host, "interrupted", "StillRunning",
                f"rank {rank} did not stop within {INTERRUPT_GRACE_S:g} s (it may be inside native "
                "code such as a collective); interrupt again, or %mesh restart"))
        ranks = format_ranks(req.ranks)
        summary = f"{req.label} {why} on ranks {ranks}"
        if still:
            summary += f"; ranks {format_ranks(still)} are still busy"
        return error_type(summary, failures)

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
        kind = "interrupted" if f.interrupted else "exception"
        failures[rank] = RankFailure(rank, state.host, kind, f.error_type, f.message, f.traceback, pid=state.pid)
    return [failures[r] for r in sorted(failures)]


def raise_failures(req: Request, runtime: MeshRuntime, partial: object = None) -> None:
    """Raise RemoteError if any rank failed the request."""
    failures = collect_failures(req, runtime)
    if not failures:
        return
    kinds = sorted({f.error_type for f in failures})
    summary = (f"{req.label} failed on {len(failures)} of {len(req.ranks)} ranks "
               f"({format_ranks([f.rank for f in failures])}): {', '.join(kinds)}")
    raise_for(failures, summary, partial)


def raise_for(failures: list[RankFailure], summary: str, partial: object,
              error: type = RemoteError, died: type = RankDiedError) -> None:
    """Raise the error that fits these failures: interrupted, a rank died, or an exception."""
    if all(f.kind == "interrupted" for f in failures):
        raise MeshInterrupted(summary, failures, partial)
    if any(f.kind == "died" for f in failures):
        raise died(summary, failures, partial)
    raise error(summary, failures, partial)
