"""Speak the Debug Adapter Protocol to a real kernel as JupyterLab does: `debug_request` on the control
channel, `debug_event` on IOPub, cells on the shell channel at the same time."""

from __future__ import annotations

import queue
import time
from typing import Any

from kernel_driver import CellRun, KernelDriver


class DapSession:
    """JupyterLab's debugger panel, for one kernel: requests, the events heard, and cells run meanwhile."""

    def __init__(self, kernel: KernelDriver):
        self.kernel = kernel
        self.seq = 0
        self.events: list[dict[str, Any]] = []
        self._runs: dict[str, CellRun] = {}
        self._control: dict[str, dict[str, Any]] = {}

    def request(self, command: str, timeout: float = 30, **arguments: Any) -> dict[str, Any]:
        """Send one request; its response (the content of the debug_reply)."""
        self.seq += 1
        kc = self.kernel.kc
        msg = kc.session.msg("debug_request", {"seq": self.seq, "type": "request", "command": command,
                                               "arguments": arguments})
        kc.control_channel.send(msg)
        msg_id = msg["header"]["msg_id"]
        deadline = time.monotonic() + timeout
        while msg_id not in self._control:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer to {command} within {timeout} s")
            self._pump_control()
            self.pump(0.02)
        return self._control.pop(msg_id)["content"]

    def _pump_control(self) -> None:
        try:
            reply = self.kernel.kc.get_control_msg(timeout=0.02)
        except queue.Empty:
            return
        self._control[reply["parent_header"].get("msg_id", "")] = reply

    def start_cell(self, code: str) -> CellRun:
        """Submit a cell; returns at once (its messages are gathered by pump)."""
        run = self.kernel.submit(code)
        self._runs[run.msg_id] = run
        return run

    def pump(self, timeout: float) -> None:
        """Take IOPub messages for `timeout` seconds: debug events, and the cells' messages."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kernel.kc.get_iopub_msg(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return
                continue
            if msg["msg_type"] == "debug_event":
                self.events.append(msg["content"])
                continue
            run = self._runs.get(msg["parent_header"].get("msg_id", ""))
            if run is not None:
                run.messages.append((time.monotonic(), msg))
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    run.reply = self.kernel.reply_to(run.msg_id, 10)

    def wait_event(self, name: str, timeout: float = 60, after: int = 0, **body: Any) -> dict[str, Any]:
        """The first event `name` (after the first `after` events) whose body has these values."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events[after:]:
                if event.get("event") == name and all(event.get("body", {}).get(k) == v for k, v in body.items()):
                    return event
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name} event within {timeout} s; heard: {[e.get('event') for e in self.events]}")
            self.pump(0.1)

    def finish(self, run: CellRun, timeout: float = 60) -> CellRun:
        """Wait for a cell's reply."""
        deadline = time.monotonic() + timeout
        while run.reply is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish within {timeout} s; got:\n{run.text()}")
            self.pump(0.1)
        return run

    def start_debugging(self) -> None:
        """What JupyterLab does when its debugger is turned on."""
        answer = self.request("initialize", clientID="jupyterlab", clientName="JupyterLab", adapterID="python",
                              pathFormat="path", linesStartAt1=True, columnsStartAt1=True, supportsVariableType=True,
                              supportsVariablePaging=True, supportsRunInTerminalRequest=True, locale="en")
        assert answer["success"], answer
        assert self.request("attach")["success"]
        assert self.request("debugInfo")["success"]

    def stop_debugging(self) -> None:
        """What JupyterLab does when its debugger is turned off."""
        assert self.request("disconnect", restart=False, terminateDebuggee=False)["success"]

    def break_at(self, cell: str, lines: list[int]) -> str:
        """Dump the cell and set breakpoints on its lines; the cell's file name."""
        path = self.request("dumpCell", code=cell)["body"]["sourcePath"]
        answer = self.request("setBreakpoints", source={"path": path},
                              breakpoints=[{"line": line} for line in lines], sourceModified=False)
        assert answer["success"], answer
        assert self.request("configurationDone")["success"]
        return path

    def variables_of_top_frame(self, thread_id: int) -> tuple[dict[str, Any], dict[str, str]]:
        """(the top frame, its first scope's variables by name) of a stopped thread."""
        frames = self.request("stackTrace", threadId=thread_id)
        assert frames["success"], frames
        top = frames["body"]["stackFrames"][0]
        scopes = self.request("scopes", frameId=top["id"])
        assert scopes["success"], scopes
        reference = scopes["body"]["scopes"][0]["variablesReference"]
        variables = self.request("variables", variablesReference=reference)
        assert variables["success"], variables
        return top, {v["name"]: v["value"] for v in variables["body"]["variables"]}
