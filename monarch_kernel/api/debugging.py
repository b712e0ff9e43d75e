"""The debugger inside one rank of a mesh, for a Debug Adapter Protocol client (JupyterLab's debugger,
through the kernel: `magics/debugger.py`).

`RankDebugTarget.start` starts debugpy's pydevd in the rank (`rank/debugging.py`); `request` sends it
DAP requests over the mesh's own links and gives their responses; its events go to `on_event`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from monarch_kernel.api import workspace
from monarch_kernel.api.mesh import Mesh
from monarch_kernel.controller.debugging import RankDebugging
from monarch_kernel.core.errors import MeshNotRunningError
from monarch_kernel.wire.messages import RunOp
from monarch_kernel.wire.ops import StartDebugger, StopDebugger

STOP_WITHIN_S = 30.0


class RankDebugTarget:
    """The debugger running in one rank, for one DAP session."""

    def __init__(self, mesh: Mesh, rank: int, session: int, pid: int):
        self.mesh = mesh
        self.rank = rank
        self.session = session
        self.pid = pid  # the rank process it runs in (a restarted rank has none)

    @classmethod
    def start(cls, mesh: Mesh, rank: int, on_event: Callable[[int, int, dict[str, Any]], None]) -> RankDebugTarget:
        """Start the debugger in `rank` (after the rank's queued work); its events go to on_event(session,
        rank, event) on the controller's loop thread."""
        session = next(RankDebugging.sessions)
        one = mesh.select_ranks([rank])
        started = next(iter(one._ask(StartDebugger(session), f"debugger on rank {rank}").values()))
        mesh._runtime.debugging.on_event = on_event
        return cls(mesh, rank, session, started.pid)

    @property
    def running(self) -> bool:
        """Whether the rank it runs in is still the one it started in."""
        state = self.mesh._runtime.ranks.get(self.rank)
        return not self.mesh.closed and state is not None and state.alive and state.pid == self.pid

    def path_mappings(self) -> list[tuple[str, str]]:
        """(folder in the notebook, the same folder on the rank) for the synced folders the rank has elsewhere."""
        return workspace.path_mappings(self.mesh._runtime, self.rank)

    def request(self, message: dict[str, Any]) -> concurrent.futures.Future[dict[str, Any]]:
        """Send one DAP request; the future holds the response (RuntimeError if the rank goes away)."""
        return self.mesh._runtime.debugging.request(self.session, self.rank, message)

    def forget(self, seq: int) -> None:
        """No longer wait for the response to request `seq`."""
        self.mesh._runtime.debugging.forget(self.session, self.rank, seq)

    def stop(self, seq: int, wait: bool) -> None:
        """Disconnect (paused threads run on) and end the rank's tracing after its queued work; with
        `wait`, return when it has ended (where a cell may wait, never from inside a DAP request)."""
        if not self.running:
            return
        self.request({"seq": seq, "type": "request", "command": "disconnect", "arguments": {}})
        label = f"debugger off on rank {self.rank}"
        if wait:
            self.mesh.select_ranks([self.rank])._ask(StopDebugger(), label, timeout=STOP_WITHIN_S)
            return
        try:  # nobody waits for its answer: the request ends by itself when the rank has done it
            self.mesh._runtime.requests.submit([self.rank], lambda req_id: RunOp(req_id, StopDebugger()), label=label)
        except MeshNotRunningError:
            pass
