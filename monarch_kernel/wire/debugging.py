"""Messages of the visual debugger (JupyterLab's, through the kernel): Debug Adapter Protocol
traffic between the notebook's debugger and the debugger inside one rank.

The DAP messages themselves are JSON text, as the protocol defines them; these classes say where
they go. Starting and stopping the rank's debugger are rank operations (`wire/ops.py`:
`StartDebugger`, `StopDebugger`), run in order on the rank's main thread; the traffic goes to and
comes from the rank's reader thread, so it flows while the main thread is paused at a breakpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.wire.message_pickling import fast_pickling


@dataclass(frozen=True)
class DebugToRank:
    """Controller -> agent -> rank: one DAP request for the rank's debugger (session `session`)."""

    ranks: tuple[int, ...]
    session: int
    dap: str  # the request, as JSON


@dataclass(frozen=True)
class DebugFromRank:
    """A rank -> agent -> controller: one DAP response or event of the rank's debugger."""

    session: int
    rank: int
    dap: str  # the response or event, as JSON


fast_pickling(vars().values(), __name__)
