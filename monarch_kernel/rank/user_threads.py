"""Which thread runs a piece of user code on a rank: the main thread when it is free, else an actor's own.

The rank's main thread runs the notebook's requests (cells, pulls, pushes, operations) in the
order they came, and a sync endpoint when it has nothing else to do: there a stop is SIGINT, as
in a local kernel, and reaches a `time.sleep` or a blocking read at once. A sync endpoint called
while the main thread is busy (a cell, or another actor's endpoint) runs on its actor's own
thread instead, so actors of one process serve their calls at the same time, as in Monarch; an
actor still serves one call at a time, whichever thread runs it. A stop reaches an endpoint on
its own thread as an asynchronous KeyboardInterrupt, raised at its next Python line; the rank's
`time.sleep` wakes for it (`rank/thread_stops.py`).

`UserThreads` is the one place that decides this and keeps the threads' bookkeeping: the main
thread's queue of jobs and whether it is free, and each actor's own thread. What runs there, and
how a stop reaches it, is `rank/runs.py`'s (a job is begun there as a run).

Threads and lock: `serve()` runs on the main thread; `submit` (the reader's requests), `place`
(the loop, or a thread that just served a call), `end` (whoever stops an actor) and `idle` from
any thread; `release` and `keep` only from the main thread, for the job it runs now. `_lock`
guards the main thread's count of jobs and flags and the map of own threads; it is a leaf (taken
under `ActorHost._lock`, nothing is taken under it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from monarch_kernel.core.hangs import ENDPOINT_THREAD_PREFIX
from monarch_kernel.rank.thread_stops import forget_thread, setup_thread

Job = Callable[[], None]
OWN_THREAD_PREFIX = ENDPOINT_THREAD_PREFIX  # the names of the actors' own threads (a hang report shows them)
IDLE_THREAD_EXITS_S = 60.0  # an actor's own thread that had nothing to run for this long ends


class UserThreads:
    """The main thread's work in order (`serve()` runs it until `close()`), and each actor's own thread,
    started when first needed, running its calls one after another."""

    def __init__(self, own_thread_prefix: str = OWN_THREAD_PREFIX) -> None:
        self._lock = threading.Lock()
        # the main thread
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._busy = 0  # jobs given to it and not finished
        self._released = False  # the job running now let the main thread count as free (`release`)
        self._running = False  # a job runs now (release and keep apply to it alone)
        # the actors' own threads
        self._prefix = own_thread_prefix
        self._own: dict[str, queue.SimpleQueue[Job | None]] = {}  # actor key -> its thread's jobs
        self.own_idents: set[int] = set()  # the own threads running now (their output belongs to no request)

    # ------------------------------------------------------------ placing work
    def submit(self, job: Job) -> None:
        """Run `job` on the main thread after what it was given before (a request)."""
        with self._lock:
            self._busy += 1
        self._jobs.put(job)

    def place(self, actor: str, job: Job) -> None:
        """Run a sync call of `actor`: on the main thread if it has nothing to do now, else on the actor's own
        thread (after what that runs now)."""
        with self._lock:
            if not self._busy:
                self._busy = 1
                self._jobs.put(job)
                return
            jobs = self._own.get(actor)
            if jobs is None:
                jobs = self._own[actor] = queue.SimpleQueue()
                threading.Thread(target=self._serve_own, args=(actor, jobs), name=f"{self._prefix}{actor}",
                                 daemon=True).start()
            jobs.put(job)

    def end(self, actor: str) -> None:
        """The actor is gone: its own thread ends after what it was given."""
        with self._lock:
            jobs = self._own.pop(actor, None)
        if jobs is not None:
            jobs.put(None)

    # ------------------------------------------------------------ the main thread's state
    def idle(self) -> bool:
        """Whether the main thread has nothing to do now."""
        with self._lock:
            return not self._busy

    def release(self) -> None:
        """The job running now (main thread) has finished its user code: the main thread counts as free
        (what it still does, sending a reply, must not send the next call to another thread)."""
        with self._lock:
            if self._running and not self._released:
                self._released = True
                self._busy -= 1

    def keep(self) -> bool:
        """The job running now (main thread), which called release(), goes on with more user code if
        nothing else was given meanwhile (True: the main thread is busy again); False: it must not."""
        with self._lock:
            others = self._busy - (0 if self._released else 1)
            if others or not self._running:
                return False
            if self._released:
                self._busy += 1
                self._released = False
            return True

    # ------------------------------------------------------------ the threads
    def close(self) -> None:
        """End `serve()` after the jobs given so far."""
        self._jobs.put(None)

    def serve(self) -> None:
        """Run the main thread's jobs as they come (main thread), until close()."""
        while True:
            try:
                job = self._jobs.get()
            except KeyboardInterrupt:  # a stop that came too late, while idle
                continue
            if job is None:
                return
            self._running = True
            try:
                job()
            except BaseException:  # noqa: BLE001 - a job reports its own errors; a late stop ends here
                pass
            finally:
                job = None  # (its arguments are let go now, not when the next job comes)
                with self._lock:
                    if not self._released:
                        self._busy -= 1
                    self._released = self._running = False

    def _serve_own(self, actor: str, jobs: queue.SimpleQueue[Job | None]) -> None:
        ident = threading.get_ident()
        setup_thread()
        self.own_idents.add(ident)
        try:
            while True:
                try:
                    job = jobs.get(timeout=IDLE_THREAD_EXITS_S)
                except queue.Empty:
                    with self._lock:  # nothing came meanwhile (place() puts under this lock): end
                        if jobs.empty() and self._own.get(actor) is jobs:
                            del self._own[actor]
                            return
                    continue
                except BaseException:  # noqa: BLE001 - a stop that came as a call ended
                    continue
                if job is None:
                    return
                _run(job)
                job = None  # (its arguments are let go now, not when the next job comes)
        finally:
            self.own_idents.discard(ident)
            forget_thread()


def _run(job: Job) -> None:
    try:
        job()
    except BaseException:  # noqa: BLE001 - a job reports its own errors; a stop that came late ends here
        pass
