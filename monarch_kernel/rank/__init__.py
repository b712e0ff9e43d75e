"""Code that runs in a rank process: the worker loop, cells, output capture, actors it hosts.

Threads of a rank, and what each runs:

- the main thread: the notebook's requests in order (`rank/worker.py`: cells, pulls, pushes,
  operations), and a sync endpoint when it has nothing else to do (`rank/user_threads.py`); a stop
  reaches it as SIGINT, raised only in the run it was sent for (`rank/interrupts.py`);
- `rank-reader`: messages from the agent; replies, cancellations, input answers, inspections and
  stops are handled here (a stop never waits behind the work it stops), the rest goes to the loop;
- `rank-loop`: the asyncio loop (delivering actor calls, the lanes' server side, links to other hosts);
- an async actor's own loop (`actor-loop-...`): its constructor, endpoints and clean-up, as in Monarch
  (`rank/actor_loops.py`), and the calls other meshes' ranks on this machine send on its own lanes
  (`rank/actor_lanes.py`); a stop cancels the endpoint's task;
- an actor's own thread (`actor-...`): its sync calls while the main thread is busy; a stop
  reaches it as an asynchronous KeyboardInterrupt (`rank/thread_stops.py`);
- `heartbeat`, the stdout/stderr flushers, `direct-lane-N` readers and `interrupt-follow-up`
  threads: no user code runs on them, and no stop is sent to them;
- with JupyterLab's debugger on this rank (`rank/debugging.py`): pydevd's own threads,
  `rank-debug-accept` (its connection, at start) and `rank-debug-relay` (its messages to the
  notebook). These and the ones above are marked untraced: the debugger never stops in them.

Every piece of work (a request, an actor call) is a run (`rank/runs.py`): a stop names runs, never
threads, reaches a run only while its user code runs, and is dropped once it has ended.

Locks, and the order they are taken in (a lock to the right may be taken while one to its left is
held, never the other way; a lock not listed under another takes nothing while held):

- stops: `Runs._lock` -> `MainThreadInterrupts._lock` -> `core.interrupt_shield._lock`; under
  `Runs._lock` a stop also wakes the actors' waits (`ActorHost._wake`) and ends a collective
  (`collectives._lock`). The main thread's SIGINT handler may run at any line, so it takes only
  `MainThreadInterrupts._lock` (re-entrant) and the lock-free `Runs.current`; inside a socket
  section of the main thread it only notes the stop, lock-free, and runs again as the section ends
  (`core.interrupt_shield.noted_in_section`);
- actors: `ActorHost._lock` (mailboxes, their queues, tasks; `ActorFailures` and `actor_instances.end_instance`
  take this same lock) -> `UserThreads._lock` (whether the main thread is free, the actors' own threads); replies are sent with no
  actor lock held;
- output: `RankStream._send_lock` (held from taking a stream's chunks until sent) -> the way out
  (`LaneServer._lock` or `BlockingConnection._send_lock`) -> `core.interrupt_shield._lock` (a write
  and its count are one step: `core/interrupt_shield.py`);
- leaves (nothing is taken under them): `UserThreads._lock`, `CallReplies._lock`,
  `BehindRequests._lock`, `NotebookInput._lock`, the far and direct links' tables
  (`rank/far_calls.py`, `rank/direct_calls.py`), `wire/calls.py`'s calls and ports, the debugger's
  `DapStream._write_lock`, `ActorHost._wake`, `collectives._lock` and `core.interrupt_shield._lock`.
"""
