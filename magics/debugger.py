"""JupyterLab's debugger on a rank: `%%mesh` cells stop at the breakpoints set in their gutter, on the
rank chosen with `%mesh debug rank N` (rank 0 of the cell's mesh unless chosen otherwise).

JupyterLab speaks the Debug Adapter Protocol to the kernel (`debug_request` on the control channel,
`debug_event` on IOPub). `MeshDebugger` takes the place of ipykernel's debugger object and keeps it
for the kernel's own code: every request goes to it as before, except those about the rank's threads,
frames and variables, which go to the debugger inside the rank (`rank/debugging.py`, debugpy's pydevd)
over the mesh's own authenticated links. The rank's ids are told apart by their range: a rank's id
`i` is shown to JupyterLab as `(rank + 1) << 32 | i`. Breakpoints and exception settings go to both.

A `%%mesh` cell that runs while JupyterLab's debugger is on starts the rank's debugger first (once;
it stays until the debugger is turned off or another rank is chosen) and runs under the file name
JupyterLab gives the cell (ipykernel's `get_file_name` of the cell's text), its lines where they are
in the cell, so the gutter's breakpoints are the rank's. The rank's debugger is told where the
project's synced folders lie on its host (path mappings), so breakpoints in those files hold there.

The rank is chosen with `%mesh debug rank N` or the Meshes sidebar (`choose`); `%mesh debug
post-mortem` stops the rank at its last error instead (`Mesh.debug_in_debugger`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.api.debugging import RankDebugTarget
from monarch_kernel.api.mesh import Mesh

RANK_IDS = 1 << 32  # ids at or above: a rank's ((rank + 1) << 32 | its own id)
MAPPED_KEYS = ("threadId", "frameId", "variablesReference")
RANK_EVENTS = frozenset({"stopped", "continued", "thread"})  # what JupyterLab hears of the rank's debugger
ANSWER_WITHIN_S = 15.0


def to_kernel_id(rank: int, value: int) -> int:
    """A rank's DAP id as JupyterLab sees it (0 and below mean "none" and stay)."""
    return (rank + 1) * RANK_IDS + value if value > 0 else value


def from_kernel_id(value: Any) -> tuple[int, int] | None:
    """(rank, the rank's own id) for an id in the ranks' range; None for the kernel's own."""
    if isinstance(value, int) and value >= RANK_IDS:
        return value // RANK_IDS - 1, value % RANK_IDS
    return None


def _map_ids(body: Any, rank: int) -> Any:
    """A rank's response or event body with its ids moved into the rank's range."""
    if isinstance(body, list):
        return [_map_ids(item, rank) for item in body]
    if not isinstance(body, dict):
        return body
    mapped = {key: _map_ids(value, rank) for key, value in body.items()}
    for key in MAPPED_KEYS:
        if isinstance(mapped.get(key), int):
            mapped[key] = to_kernel_id(rank, mapped[key])
    for key in ("threads", "stackFrames"):
        for item in mapped.get(key) or ():
            if isinstance(item, dict) and isinstance(item.get("id"), int):
                item["id"] = to_kernel_id(rank, item["id"])
                if key == "threads":
                    item["name"] = f"rank {rank}: {item.get('name', '')}"
    return mapped


def _failure(message: dict[str, Any], why: str) -> dict[str, Any]:
    return {"type": "response", "seq": 0, "request_seq": message.get("seq", 0), "command": message.get("command"),
            "success": False, "message": why, "body": {}}


@dataclass
class RankLink:
    """The debugger running in one rank, for this kernel's DAP session."""

    target: RankDebugTarget
    paused: set[int] = field(default_factory=set)  # JupyterLab's ids of the rank's threads stopped now
    mappings: list[tuple[str, str]] = field(default_factory=list)  # the synced folders it was told of

    @property
    def rank(self) -> int:
        """The rank debugged."""
        return self.target.rank


class MeshDebugger:
    """ipykernel's debugger, and the debugger in the chosen rank of a mesh (see the module's docstring)."""

    def __init__(self, kernel_debugger: Any):
        self._inner = kernel_debugger
        self._publish = kernel_debugger.event_callback
        self._lock = threading.RLock()
        self._seq = itertools.count(1 << 40)  # our own requests to a rank (JupyterLab's are small)
        self._config: dict[str, dict[str, Any]] = {}  # JupyterLab's initialize/attach/exception arguments
        self.chosen_mesh: str | None = None  # None: the mesh the cell runs on
        self.chosen_rank = 0
        self.link: RankLink | None = None
        self.raw_cell = ""  # the text of the cell now running, as JupyterLab sent it

    def remember_cell(self, info: Any) -> None:
        """IPython's pre_run_cell: the cell's text as JupyterLab sent it (its debugger names files by it);
        with the debugger on, the kernel's own thread traced again if the stop button untraced it."""
        self.raw_cell = getattr(info, "raw_cell", "") or ""
        if self.is_on and sys.gettrace() is None and "debugpy" in sys.modules:
            # A KeyboardInterrupt raised inside debugpy's trace function makes Python drop the tracer, and
            # no later cell would stop at a breakpoint (ipykernel#821, jupyterlab#15012).
            import debugpy

            debugpy.trace_this_thread(True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # the kernel uses the rest as it did

    @property
    def is_on(self) -> bool:
        """Whether JupyterLab's debugger is on for this kernel."""
        return bool(getattr(self._inner, "is_started", False))

    # ------------------------------------------------------------ requests (the control thread)
    async def process_request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Answer one DAP request from JupyterLab."""
        command = message.get("command", "")
        if command in ("initialize", "attach", "setExceptionBreakpoints"):
            self._config[command] = dict(message.get("arguments") or {})
        arguments = message.get("arguments") or {}
        link = self.link
        if (command == "continue" and link is not None and link.paused and from_kernel_id(arguments.get("threadId")) is None
                and not getattr(self._inner, "stopped_threads", None)):
            # JupyterLab's Continue forgets the paused thread before it asks, and asks for thread 1: with only
            # the rank paused, that means the rank
            arguments = {**arguments, "threadId": min(link.paused)}
            message = {**message, "arguments": arguments}
        for key in MAPPED_KEYS:
            owner = from_kernel_id(arguments.get(key))
            if owner is not None:
                return await self._to_rank(owner[0], message)
        reply = await self._inner.process_request(message)
        if link is not None and command in ("setBreakpoints", "setExceptionBreakpoints"):
            await self._ask(link, command, arguments)
        elif link is not None and command == "threads" and reply.get("success"):
            answer = await self._ask(link, "threads", {})
            rank_threads = _map_ids(answer.get("body") or {}, link.rank).get("threads", [])
            reply.setdefault("body", {}).setdefault("threads", []).extend(rank_threads)
        elif link is not None and command == "debugInfo":
            reply.setdefault("body", {}).setdefault("stoppedThreads", []).extend(sorted(link.paused))
        elif command == "disconnect":
            self.detach(stop_tracing=False)  # (the rank ends its tracing after its queued work; nothing waits here)
        return reply

    async def _to_rank(self, rank: int, message: dict[str, Any]) -> dict[str, Any]:
        link = self.link
        if link is None or link.rank != rank:
            return _failure(message, f"rank {rank} is not being debugged now")
        arguments = dict(message.get("arguments") or {})
        for key in MAPPED_KEYS:
            owner = from_kernel_id(arguments.get(key))
            if owner is not None:
                arguments[key] = owner[1]
        try:
            answer = await self._send(link, dict(message, arguments=arguments))
        except RuntimeError as exc:
            return _failure(message, str(exc))
        return _map_ids(answer, rank)

    async def _ask(self, link: RankLink, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._send(link, {"seq": next(self._seq), "type": "request", "command": command,
                                           "arguments": arguments})
        except RuntimeError as exc:
            return {"success": False, "message": str(exc)}

    async def _send(self, link: RankLink, request: dict[str, Any]) -> dict[str, Any]:
        answer = link.target.request(request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(answer), ANSWER_WITHIN_S)
        except TimeoutError:
            link.target.forget(int(request["seq"]))
            raise RuntimeError(f"rank {link.rank}'s debugger did not answer within {ANSWER_WITHIN_S:.0f} s "
                               "(is the rank stuck in a C call?)") from None

    # ------------------------------------------------------------ the rank's events (the loop thread)
    def _on_rank_event(self, session: int, rank: int, event: dict[str, Any]) -> None:
        link = self.link
        if link is None or link.target.session != session or event.get("event") not in RANK_EVENTS:
            return
        event = _map_ids(event, rank)
        body = event.get("body") or {}
        if event["event"] == "stopped":
            link.paused.add(body.get("threadId", 0))
        elif event["event"] == "continued":
            if body.get("allThreadsContinued", True):
                link.paused.clear()
            else:
                link.paused.discard(body.get("threadId", 0))
        self._publish(event)

    # ------------------------------------------------------------ a %%mesh cell (the main thread)
    def prepare(self, target: Mesh) -> str | None:
        """Before a `%%mesh` cell on `target`: with JupyterLab's debugger on and the chosen rank among
        the cell's, the rank's debugger runs; the file name the cell must run under (else None)."""
        if not self.is_on:
            self.detach()
            return None
        if self.chosen_mesh is not None and target.name != self.chosen_mesh:
            return None
        if self.chosen_rank not in target.ranks:
            return None
        from ipykernel.compiler import get_file_name

        with self._lock:
            link = self.link
            current = (link is not None and link.target.mesh.name == target.name and link.rank == self.chosen_rank
                       and link.target.running and link.mappings == link.target.path_mappings())  # (a sync since?)
            if not current:
                self.detach()
                self.link = self._start(target, self.chosen_rank)
        return str(get_file_name(self.raw_cell)) if self.raw_cell else None

    def choose(self, mesh: Mesh, rank: int) -> str:
        """Make `rank` of `mesh` the rank the debugger stops in (`%mesh debug rank N`, the sidebar's
        "Debug this rank"); with the debugger on, its debugger starts now. What to tell the user."""
        if rank not in mesh.ranks:
            raise ValueError(f"mesh {mesh.name!r} has no rank {rank} (its ranks: 0..{len(mesh.ranks) - 1})")
        self.chosen_mesh, self.chosen_rank = mesh.name, rank
        self.prepare(mesh)  # (on now: breakpoints in actor endpoints hold from here on)
        state = "on" if self.is_on else "off (turn it on in JupyterLab's toolbar)"
        return (f"JupyterLab's debugger stops in rank {rank} of mesh {mesh.name!r} at %%mesh cells' breakpoints; "
                f"it is {state}")

    def debugged_rank(self, mesh_name: str) -> int | None:
        """The rank of mesh `mesh_name` the debugger stops in (None: another mesh's rank was chosen)."""
        return self.chosen_rank if self.chosen_mesh in (None, mesh_name) else None

    def cell_code(self, body: str) -> str:
        """The cell's body with the lines above it in the cell (the `%%mesh` line) left blank."""
        at = self.raw_cell.find(body) if body else -1
        above = self.raw_cell[:at].count("\n") if at > 0 else 1
        return "\n" * above + body

    def _start(self, target: Mesh, rank: int) -> RankLink:
        link = RankLink(RankDebugTarget.start(target, rank, self._on_rank_event))
        self._replay(link)
        return link

    def _replay(self, link: RankLink) -> None:
        """Tell the new rank debugger what JupyterLab told the kernel's: its settings and breakpoints."""
        attach = {**self._config.get("attach", {}), "justMyCode": True}  # steps stay in the cells (torch, ours: run through)
        attach.pop("connect", None)
        link.mappings = link.target.path_mappings()
        mappings = [{"localRoot": here, "remoteRoot": there} for here, there in link.mappings]
        if mappings:  # the project's files as the notebook names them, where this rank's host has them
            attach["pathMappings"] = [*attach.get("pathMappings", []), *mappings]
        steps: list[tuple[str, dict[str, Any]]] = [("initialize", self._config.get("initialize", {})),
                                                   ("attach", attach)]
        for path, breakpoints in dict(getattr(self._inner, "breakpoint_list", {})).items():
            steps.append(("setBreakpoints", {"source": {"path": path}, "breakpoints": breakpoints,
                                             "lines": [b["line"] for b in breakpoints], "sourceModified": False}))
        if "setExceptionBreakpoints" in self._config:
            steps.append(("setExceptionBreakpoints", self._config["setExceptionBreakpoints"]))
        steps.append(("configurationDone", {}))
        for command, arguments in steps:
            seq = next(self._seq)
            answer = link.target.request({"seq": seq, "type": "request", "command": command, "arguments": arguments})
            try:
                reply = answer.result(ANSWER_WITHIN_S)
            except concurrent.futures.TimeoutError:
                link.target.forget(seq)
                raise RuntimeError(f"rank {link.rank}'s debugger did not answer {command} within "
                                   f"{ANSWER_WITHIN_S:.0f} s") from None
            if not reply.get("success", False):
                raise RuntimeError(f"rank {link.rank}'s debugger refused {command}: {reply.get('message', '')}")

    def detach(self, stop_tracing: bool = True) -> None:
        """End the rank's debugger (its threads run on); nothing if none runs. `stop_tracing` (the main
        thread only): also wait until the rank's threads run untraced again."""
        with self._lock:
            link, self.link = self.link, None
        if link is None:
            return
        if link.paused:
            self._publish({"type": "event", "seq": 0, "event": "continued",
                           "body": {"threadId": min(link.paused), "allThreadsContinued": True}})
        link.target.stop(next(self._seq), wait=stop_tracing)


def install(shell: Any) -> MeshDebugger | None:
    """Put a MeshDebugger in place of the kernel's debugger (None: no kernel, or no debugger in it)."""
    kernel = getattr(shell, "kernel", None)
    inner = getattr(kernel, "debugger", None)
    if inner is None:
        return None
    if isinstance(inner, MeshDebugger):
        return inner
    debugger = MeshDebugger(inner)
    kernel.debugger = debugger  # type: ignore[union-attr]
    shell.events.register("pre_run_cell", debugger.remember_cell)
    return debugger


def uninstall(shell: Any) -> None:
    """Give the kernel its own debugger back (the rank's, if one runs, ends)."""
    kernel = getattr(shell, "kernel", None)
    debugger = getattr(kernel, "debugger", None)
    if isinstance(debugger, MeshDebugger):
        debugger.detach(stop_tracing=False)
        shell.events.unregister("pre_run_cell", debugger.remember_cell)
        kernel.debugger = debugger._inner  # type: ignore[union-attr]
