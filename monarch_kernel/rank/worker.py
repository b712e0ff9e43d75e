"""The rank runtime: one process per rank, serving requests from its host agent.

A reader thread takes every message off the agent's connection: replies to this rank's own actor
calls, cancellations, input() answers and stops (SIGINT for the main thread, and the end of a
collective it waits in) are handled right there. Requests (cells, pulls, pushes, operations) go to
the main thread, which runs them one at a time in the order they came (a stop raises
KeyboardInterrupt, as in a local kernel). Actor calls go to their actor (the notebook's by way of
the rank's event loop, in order with its requests); the loop, on a thread of its own, also serves the
direct lanes and runs async endpoints; sync endpoints run on the main thread when it is free, else on
their actor's own thread (`rank/user_threads.py`). A daemon thread answers heartbeats. Never imports
IPython, rich or ipywidgets: ranks start light.
"""

from __future__ import annotations

import _signal
import asyncio
import functools
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed, SerializationError
from monarch_kernel.core.interrupt_shield import noted_in_section, notes_in_sections
from monarch_kernel.core.package import PACKAGE_DIR
from monarch_kernel.core.shell_syntax import MESH_SHELL
from monarch_kernel.rank import collectives
from monarch_kernel.rank.actor_host import ActorHost
from monarch_kernel.rank.autoreload import Reloader
from monarch_kernel.rank.capture import DisplayCapture, RankStream
from monarch_kernel.rank.cell import CellRunner, describe_failure
from monarch_kernel.rank.debugging import RankDebugger, ensure_source_file, untraced
from monarch_kernel.rank.far_calls import CallListener
from monarch_kernel.rank.inspect import inspect
from monarch_kernel.rank.interrupts import MainThreadInterrupts
from monarch_kernel.rank.notebook_input import NotebookInput, breakpoint_in_the_notebook
from monarch_kernel.rank.ops import RankOps
from monarch_kernel.rank.rankshell import RankShell
from monarch_kernel.rank.runs import Run, RunKey, RunKind
from monarch_kernel.rank.thread_stops import install_sleep
from monarch_kernel.rank.user_threads import UserThreads
from monarch_kernel.wire.debugging import DebugToRank
from monarch_kernel.wire.diagnosis import CollectivesAborted, InspectRanks, RankInspection
from monarch_kernel.wire.fd_marks import FdMarkReader, fd_mark_path
from monarch_kernel.wire.lane_server import LaneServer, accept_lane, listen_lane
from monarch_kernel.wire.lanes import lane_path
from monarch_kernel.wire.messages import (
    ActorCall,
    ActorReply,
    Call,
    CancelCall,
    DirectRoute,
    Display,
    Failure,
    InputReply,
    InputRequest,
    InterruptRanks,
    ListenForCalls,
    Output,
    Pull,
    Push,
    Result,
    RunCell,
    RunOp,
)
from monarch_kernel.wire.serialization import seal, unseal
from monarch_kernel.wire.stand_ins import stand_in_for
from monarch_kernel.wire.transport import BlockingConnection

READY_REQ = 0  # req_id of the rank's start-up reply
REQUESTS = frozenset({RunCell, Pull, Push, Call, RunOp})  # what a rank runs for the notebook, by the agent or a lane
REQUEST_REPLIES = frozenset({Output, Display, InputRequest, Result, CollectivesAborted})  # what a rank sends back about a request


def _fd_mark_reader(config: WorkerConfig) -> FdMarkReader | None:
    """The page where the agent counts this rank's fd output (on the notebook's machine only)."""
    try:
        return FdMarkReader(fd_mark_path(config.shm_dir, config.rank)) if config.shm_dir else None
    except OSError:  # a rank started by hand (tests): no agent counts its output
        return None


@dataclass
class WorkerConfig:
    """What a forked rank needs to know."""

    rank: int
    host: str
    shm_dir: str | None
    mesh: str = ""  # the mesh's name


class Worker:
    """Serves one rank: runs cells, pushes, pulls and calls in its namespace."""

    def __init__(self, conn: BlockingConnection, config: WorkerConfig):
        self.conn = conn
        self.config = config
        self.current_req: int | None = None
        self.current_label = ""  # what the request running now is called ("In[7]", "pull")
        self.interrupts = MainThreadInterrupts()  # SIGINT for the main thread that is not lost
        self._lane_routes: dict[int, Callable[[Any], None]] = {}  # req_id -> the lane it came by
        self._fd_marks = _fd_mark_reader(config)
        # cells run in `__main__`, as in a notebook or a script (`if __name__ == "__main__":` runs)
        self.module = types.ModuleType("__main__", "namespace of the cells run on this rank")
        self.namespace = self.module.__dict__
        self.namespace["__builtins__"] = __builtins__
        self.runner = CellRunner(self.namespace)
        self.shell = RankShell(self.namespace, self.runner.run)  # `!cmd` and magics of mesh cells
        self.stdout = RankStream("stdout", config.rank, self._send)
        self.stderr = RankStream("stderr", config.rank, self._send)
        self.displays = DisplayCapture(config.rank, self._send, lambda: self.current_req, self.flush_streams)
        self.reloader = Reloader(config.rank)  # modules of synced workspaces (`Mesh.autoreload`)
        self.debugger = RankDebugger(config.rank, self._send)  # JupyterLab's debugger, when it debugs this rank
        self.ops = RankOps(config.rank, self.namespace, self.runner, self.reloader, self.debugger)  # internal operations
        self.threads = UserThreads()  # requests on the main thread; sync endpoints there when it is free, else their own
        self.actors = ActorHost(config.rank, self._send, config.shm_dir, self.ops, self.interrupts, self.threads,
                                config.mesh)
        self.runs = self.actors.runs  # every request and actor call, and the stops addressed to them
        self.runs.broken_by_peer = collectives.broken_by_peer
        self.runs.on_collective_ended = self._collective_ended
        self.stdout.outside_requests = self.stderr.outside_requests = self.threads.own_idents
        self.lane_listener = listen_lane(lane_path(config.shm_dir, config.rank)) if config.shm_dir else None
        self.far_calls = CallListener(config.rank, self._serve_far, self._send)  # (listens once asked to)
        self.namespace["actors"] = self.actors.instances
        self.input = NotebookInput(config.rank, self._send, lambda: self.current_req, self.flush_streams)
        self._sigint_handler = self._on_sigint  # the one installed (bound once: checked after every request)
        self.interrupts.handler = self._sigint_handler
        notes_in_sections(self._sigint_handler)  # (a reply's write leaves it installed: `core/interrupt_shield.py`)
        self._main_thread = threading.main_thread().ident or 0
        self._run: Run | None = None  # the request running now on the main thread

    def _send(self, msg: Any) -> None:
        """To the agent; a request's output and result go back the lane it came by, if it did."""
        if self._lane_routes and type(msg) in REQUEST_REPLIES:
            route = self._lane_routes.get(msg.req_id)
            if route is not None:
                try:
                    route(msg)
                    return
                except ConnectionClosed:  # the notebook closed the lane (a restart): the agent's way is open
                    pass
        self.conn.send(msg)

    def install(self) -> None:
        """Take over stdout/stderr, display(), `__main__` and SIGINT for this process."""
        sys.stdout, sys.stderr = self.stdout, self.stderr
        sys.modules["__main__"] = self.module
        sys.argv = ["<mesh>"]  # a pasted script's argparse sees no arguments (not the agent's)
        import builtins

        builtins.display = self.displays.display  # type: ignore[attr-defined]
        builtins.input = self.input.input  # pdb (breakpoint()) reads its commands with input() too
        import getpass

        getpass.getpass = self.input.getpass
        sys.breakpointhook = breakpoint_in_the_notebook
        self.displays.patch_ipython()
        signal.signal(signal.SIGINT, self._sigint_handler)
        install_sleep()  # a stop wakes an endpoint asleep on its actor's own thread

    def _interrupt(self, msg: InterruptRanks) -> None:
        """Reader thread: stop these requests, now if one runs user code, else as its user code starts (a
        stop can overtake its request); with `running`, also whatever user code runs now (a cell or a sync
        endpoint). See `rank/runs.py`."""
        self.debugger.resume()  # threads paused at a breakpoint run on, into the stop
        self.runs.stop(msg.req_ids, running=msg.running)

    def _collective_ended(self, key: RunKey, how: str) -> None:
        """Reader thread: a stop ended the collective a request waits in. Said now, not only before its result:
        the notebook then waits for that rank's answer beyond its usual grace (the rank will answer, however
        long a loaded machine takes to unwind the collective) and makes the group anew after."""
        if isinstance(key, int):  # (an actor call's answer says so itself: `rank/call_replies.py`)
            self._send(CollectivesAborted(key, self.config.rank, how))

    @property
    def in_user_code(self) -> bool:
        """Whether user code runs on the main thread now (a request's or an endpoint's)."""
        return self.runs.user_code_on(self._main_thread)

    def running_label(self) -> str:
        """What runs on this rank now: the cell ("In[7]"), an endpoint, or "" when idle."""
        if self.current_label:
            return self.current_label
        return self.actors.doing.describe().rsplit(" ", 1)[0]

    def activity(self) -> str:
        """What the heartbeat tells the agent: the actors' activity, the collective the main thread
        waits in, and the request it runs as "REQ_ID:LABEL" (tab-separated; trailing empty ones left out)."""
        doing = self.actors.doing.describe()
        waiting = collectives.brief() if self.in_user_code else ""
        request = f"{self.current_req}:{self.current_label}" if self.current_req is not None else ""
        return "\t".join((doing, waiting, request)).rstrip("\t")

    def _on_sigint(self, signum, frame) -> None:
        if noted_in_section(signum, frame):  # a write and its count: this runs again as it ends
            return
        if self.interrupts.claim():
            raise KeyboardInterrupt
        # idle, in our own code, or running another run than the stop's: a stop that came too late (or is
        # for a cell whose wait serves an endpoint now) is not raised here; its follow-up sends it again

    def flush_streams(self) -> None:
        """Send pending stdout/stderr text now."""
        self.stdout.flush()
        self.stderr.flush()

    def serve(self) -> None:
        """Handle requests until the agent goes away (the main thread)."""
        loop = asyncio.new_event_loop()
        self.actors.loop = self.actors.sender.direct.far.loop = loop
        if self.lane_listener is not None:
            loop.add_reader(self.lane_listener.fileno(), self._accept_lane)
        threading.Thread(target=self.actors.run_loop, args=(loop,), name="rank-loop", daemon=True).start()
        untraced(threading.Thread(target=self._read, args=(loop,), name="rank-reader", daemon=True)).start()
        self.threads.serve()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: replies and cancellations here, the rest to the loop."""
        while True:
            try:
                msg = self.conn.recv()
            except ConnectionClosed:
                loop.call_soon_threadsafe(loop.stop)
                self.threads.close()
                return
            try:
                self._route(loop, msg)
            except Exception:  # noqa: BLE001 - one bad message must not leave the rank deaf
                traceback.print_exc()

    def _route(self, loop: asyncio.AbstractEventLoop, msg: Any) -> None:
        if isinstance(msg, ActorReply):
            self.actors.sender.calls.deliver(msg)
            self.actors.notify()  # the main thread may be waiting on it while serving other actors
        elif isinstance(msg, CancelCall):
            self.actors.cancel(msg)
        elif isinstance(msg, InputReply):
            self.input.reply(msg)
        elif isinstance(msg, DirectRoute):  # where another mesh's ranks listen: call them directly
            self.actors.sender.direct.learn(msg)
        elif isinstance(msg, ListenForCalls):  # other meshes' ranks on other hosts will call this one directly
            asyncio.run_coroutine_threadsafe(self.far_calls.listen(msg), loop)
        elif isinstance(msg, InterruptRanks):
            self._interrupt(msg)
        elif isinstance(msg, InspectRanks):  # answered here, whatever the main thread does
            self._send(RankInspection(msg.inspect_id, self.config.rank,
                                      inspect(self.config.rank, self.running_label(), msg.all_threads,
                                              msg.stacks_only, msg.counters_only)))
        elif isinstance(msg, DebugToRank):  # the notebook's debugger, also while the main thread is paused
            self.debugger.to_debugger(msg)
        elif isinstance(msg, ActorCall):
            self.actors.arrived(msg)
        else:
            self._queue_request(msg)

    def _accept_lane(self) -> None:
        if self.lane_listener is None:
            return
        sock = accept_lane(self.lane_listener)
        if sock is None:
            return
        lane: list[LaneServer] = []
        reply: list[Callable[[Any], None]] = []  # its send, bound once

        def on_message(msg: Any) -> None:
            if isinstance(msg, ActorCall):
                self.actors.deliver(msg, reply[0])
            elif isinstance(msg, CancelCall):  # (of a call another mesh's rank sent on this lane)
                self.actors.cancel(msg)
            elif type(msg) in REQUESTS:  # to the main thread, in the order it came; replies go back this lane
                self._lane_routes[msg.req_id] = reply[0]
                self._queue_request(msg)

        lane.append(LaneServer(sock, asyncio.get_running_loop(), on_message))
        reply.append(lane[0].send)

    def _serve_far(self, msg: ActorCall | CancelCall, reply: Callable[[Any], None]) -> None:
        """A call (or its cancel) from another mesh's rank on another host, on its link (loop thread)."""
        if isinstance(msg, ActorCall):
            self.actors.deliver(msg, reply)
        else:
            self.actors.cancel(msg)

    def _queue_request(self, msg: Any) -> None:
        """To the main thread, after the requests before it; the notebook's later calls wait for it."""
        self.actors.order.request_queued()
        self.threads.submit(functools.partial(self._handle_request, msg))

    def _handle_request(self, msg: Any) -> None:
        self.actors.order.request_runs(True)
        try:
            self.handle(msg)
        except Exception:  # noqa: BLE001 - the requests behind it must still be served
            traceback.print_exc()
        finally:
            if self.actors.order.request_runs(False):
                self.actors.on_loop(self.actors.release_held)

    def _set_request(self, req_id: int | None, label: str = "") -> None:
        self.current_req = self.stdout.request_id = self.stderr.request_id = req_id
        self.current_label = label

    def handle(self, msg: Any) -> None:
        """Run one request and send its Result ((1): on a lane, the fd output to show before it)."""
        self._set_request(msg.req_id, _label_of(msg))
        self._run = run = self.runs.begin(msg.req_id, RunKind.REQUEST, self.current_label)
        started = time.time()
        value, failure = None, None
        try:
            value = self._dispatch(msg)
        except BaseException as exc:  # noqa: BLE001 - every user error is reported
            failure = describe_failure(exc)
            self.runs.failed(run, exc)  # (a peer's stop ended its collective first: the stop is told so)
            if not failure.interrupted and self.runs.ended_by_its_stop(run):
                failure = replace(failure, interrupted=True)  # (the stop's doing, not the cell's)
            if not isinstance(exc, SystemExit):  # for post-mortem debugging (%mesh debug), as IPython keeps it
                sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, _user_frames(exc.__traceback__)
        finally:
            self.runs.end(run)  # (a stop that comes from now on is dropped: never raised in the next request)
        if aborted := self.runs.answered(msg.req_id):  # its collective was ended: said before its result
            self._send(CollectivesAborted(msg.req_id, self.config.rank, aborted))
        sealed = None
        if failure is None:
            sealed, failure = self._seal_value(msg, value)
        try:
            self.displays.flush_figures()
        except Exception as exc:  # noqa: BLE001
            print(f"monarch_kernel: could not render figures: {exc}", file=self.stderr)
        self.stdout.finish_request(msg.req_id)
        self.stderr.finish_request(msg.req_id)
        self._set_request(None)
        if _signal.getsignal(signal.SIGINT) is not self._sigint_handler:  # (signal.getsignal makes an enum)
            signal.signal(signal.SIGINT, self._sigint_handler)  # the cell installed its own: stop must work next time
        mark = self._fd_marks.mark() if msg.req_id in self._lane_routes and self._fd_marks is not None else 0  # (1)
        self.threads.release()  # the main thread is free once the result is out: what the notebook sends next may run here
        self._send(Result(msg.req_id, self.config.rank, sealed, failure, started, time.time(), mark))
        self._lane_routes.pop(msg.req_id, None)

    def _dispatch(self, msg: Any) -> Any:
        if isinstance(msg, RunCell):
            sys.last_type = sys.last_value = sys.last_traceback = None  # %mesh debug: this cell's error only
            if MESH_SHELL in msg.code:
                self.namespace[MESH_SHELL] = self.shell  # even after a cell cleared its globals
            if self.reloader.enabled:
                self._user(self.reloader.check, self._warn)
            if self.debugger.active and os.path.isabs(msg.filename):  # the notebook's name for the cell
                ensure_source_file(msg.filename, msg.code)
            try:
                return self._user(self.runner.run, msg.code, msg.filename)
            finally:
                self.reloader.after_cell()
        if isinstance(msg, Pull):
            return self._user(self.runner.evaluate, msg.expr)
        if isinstance(msg, Push):
            values = unseal(msg.values)
            self.namespace.update(values)
            return None
        if isinstance(msg, RunOp):
            return self._user(self.ops.handle, msg.op)
        if isinstance(msg, Call):
            fn = unseal(msg.fn)
            return self._user(fn)
        raise TypeError(f"unknown request {type(msg).__name__}")

    def _user(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) as the request's user code: its stop raises KeyboardInterrupt there (`rank/runs.py`)."""
        assert self._run is not None, "user code of a request runs inside handle()"
        return self.runs.user_code(self._run, fn, *args)

    def _warn(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def _seal_value(self, msg: Any, value: Any) -> tuple[Any, Failure | None]:
        if value is None:  # (most cells and pushes: nothing to pickle, nothing to unpickle)
            return None, None
        try:
            return seal(value, shm_dir=self.config.shm_dir), None
        except SerializationError as exc:
            if isinstance(msg, RunCell):
                stand_in = stand_in_for(value, str(exc.__cause__), self.config.rank)
                return seal(stand_in, shm_dir=self.config.shm_dir), None
            return None, Failure("SerializationError", str(exc), "")


def _label_of(msg: Any) -> str:
    """How a verdict names a request: the cell's name ("In[7]"), else its kind."""
    if isinstance(msg, RunCell):
        return msg.filename.removeprefix("<mesh ").removesuffix(">")
    if isinstance(msg, RunOp):
        return type(msg.op).__name__
    return type(msg).__name__.lower()


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the first frame that is not monarch_kernel's own (the cell's)."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    return tb

