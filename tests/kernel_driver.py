"""Drive a real Jupyter kernel (jupyter_client) and record what a frontend would see."""

from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass, field

from jupyter_client.manager import KernelManager


@dataclass
class CellRun:
    """Everything the kernel published for one execute request."""

    msg_id: str
    started: float
    reply: dict | None = None
    messages: list[tuple[float, dict]] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # input boxes the cell opened
    masked: list[str] = field(default_factory=list)  # ... of which password boxes
    displays: dict[str, dict] = field(default_factory=dict)  # display_id -> latest data

    def outputs(self) -> list[dict]:
        """The cell's outputs as a notebook would hold them (updates applied)."""
        outs: list[dict] = []
        for _, msg in self.messages:
            kind, content = msg["msg_type"], msg["content"]
            if kind in ("stream", "error", "execute_result", "display_data"):
                outs.append({"type": kind, **content})
            elif kind == "update_display_data":
                did = content.get("transient", {}).get("display_id")
                for out in outs:
                    if out.get("transient", {}).get("display_id") == did:
                        out["data"] = content["data"]
        return outs

    def text(self) -> str:
        """All text/plain and stream text of the outputs, joined."""
        parts = []
        for out in self.outputs():
            if out["type"] == "stream":
                parts.append(out["text"])
            elif out["type"] == "error":
                parts.append("\n".join(out["traceback"]))
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
        return "\n".join(parts)

    @property
    def status(self) -> str:
        """The execute_reply status (ok, error, aborted)."""
        return self.reply["content"]["status"] if self.reply else "pending"


class KernelDriver:
    """A started kernel with the monarch_kernel extension available."""

    def __init__(self, kernel_name: str = "python3", extra_env: dict[str, str] | None = None):
        env = dict(os.environ, **(extra_env or {}))
        self.km = KernelManager(kernel_name=kernel_name)
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self._replies: dict[str, dict] = {}  # shell replies that came while waiting for another request's

    @property
    def pid(self) -> int:
        """The kernel process id."""
        return self.km.provisioner.process.pid

    def submit(self, code: str) -> CellRun:
        """Send an execute request; returns at once."""
        return CellRun(self.kc.execute(code), time.monotonic())

    def collect(self, run: CellRun, timeout: float = 60, until=None, answers: list[str] | None = None) -> CellRun:
        """Gather iopub messages of the run until idle (or until(run) is true).

        `answers` are typed, in order, into the input boxes the cell opens (input(), pdb);
        their prompts are kept in run.prompts.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if answers is not None:
                self._answer_input(run, answers)
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                if until is not None and until(run):
                    return run
                continue
            if msg["parent_header"].get("msg_id") != run.msg_id:
                if msg["msg_type"] == "update_display_data":
                    run.messages.append((time.monotonic(), msg))
                continue
            run.messages.append((time.monotonic(), msg))
            if until is not None and until(run):
                return run
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                run.reply = self.reply_to(run.msg_id, 10)
                return run
        raise TimeoutError(f"cell did not finish within {timeout} s; got:\n{run.text()}")

    def reply_to(self, msg_id: str, timeout: float) -> dict:
        """The shell reply that answers request `msg_id` (replies to other requests are kept for theirs)."""
        if msg_id in self._replies:
            return self._replies.pop(msg_id)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.0, deadline - time.monotonic()))
            parent = reply["parent_header"].get("msg_id")
            if parent == msg_id:
                return reply
            self._replies[parent] = reply

    def execute(self, code: str, timeout: float = 60, answers: list[str] | None = None) -> CellRun:
        """Run a cell to completion (typing `answers` into the input boxes it opens)."""
        return self.collect(self.submit(code), timeout, answers=answers)

    def _answer_input(self, run: CellRun, answers: list[str]) -> None:
        try:
            msg = self.kc.get_stdin_msg(timeout=0)
        except queue.Empty:
            return
        if msg["msg_type"] == "input_request":
            run.prompts.append(msg["content"]["prompt"])
            if msg["content"].get("password"):
                run.masked.append(msg["content"]["prompt"])
            self.kc.input(answers.pop(0) if answers else "")

    def interrupt(self) -> None:
        """What the notebook's stop button does."""
        self.km.interrupt_kernel()

    def kill(self) -> None:
        """SIGKILL the kernel process."""
        os.kill(self.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        """Stop channels and the kernel."""
        try:
            self.kc.stop_channels()
        finally:
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)


def kernel_with(setup: str, extra_env: dict[str, str] | None = None):
    """A started kernel that ran `setup` successfully (a generator for module fixtures)."""
    kernel = KernelDriver(extra_env=extra_env)
    try:
        run = kernel.execute(setup, 120)
        assert run.status == "ok", run.text()
        yield kernel
    finally:
        kernel.shutdown()
