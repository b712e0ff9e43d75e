"""Code that runs in a rank process: the worker loop, cells, output capture, actors it hosts.

Threads of a rank, and what each runs:

- the main thread: the notebook's requests in order (`rank/worker.py`: cells, pulls, pushes,
  operations), and a sync endpoint when it has nothing else to do (`rank/user_threads.py`); a stop
  reaches it as SIGINT, raised only in the run it was sent for (`rank/interrupts.py`);
- `rank-reader`: messages from the agent; replies, cancellations, input answers, inspections and
  stops are handled here (a stop never waits behind the work it stops), the rest goes to the loop;
- `rank-loop`: the asyncio loop (async endpoints, the lanes' server side, links to other hosts);
- an actor's own thread (`actor-...`): its sync calls while the main thread is busy; a stop
  reaches it as an asynchronous KeyboardInterrupt (`rank/thread_stops.py`);
- `heartbeat`, the stdout/stderr flushers, `direct-lane-N` readers and `interrupt-follow-up`
  threads: no user code runs on them, and no stop is sent to them;
- with JupyterLab's debugger on this rank (`rank/debugging.py`): pydevd's own threads,
  `rank-debug-accept` (its connection, at start) and `rank-debug-relay` (its messages to the
  notebook). These and the ones above are marked untraced: the debugger never stops in them.

The stop machinery's locks, and the order they are taken in (a lock to the right may be taken while
one to its left is held, never the other way): `Worker._stops_lock` -> `SyncCallStops._lock` ->
`MainThreadInterrupts._lock` -> `core.interrupt_shield._lock` (a leaf: nothing is taken under it).
Under the first two, a stop also wakes the actors' waits (`ActorHost._wake`), ends a collective
(`collectives._lock`) and sends a message (the connection's and the lane's write locks); none of
those takes a stop lock but the leaf. The main thread's SIGINT handler
may run at any line, so it takes only `MainThreadInterrupts._lock` (re-entrant), and the run
predicates it calls take no lock. A socket write or read and the count of what it did are never
split by a stop (`core/interrupt_shield.py`). The other locks (the actors' state, replies, lanes,
calls, capture) are listed in their classes; their order is not yet written here (issue 41).
"""
