"""The Meshes sidebar's comm protocol, spoken to a real kernel as JupyterLab would."""

import copy
import queue
import time
import uuid

import pytest
from kernel_driver import KernelDriver, kernel_with

TARGET = "monarch_kernel.meshes"


class Panel:
    """A frontend end of the comm: opens it, sends requests, collects what the kernel says."""

    def __init__(self, kernel: KernelDriver, subshell: bool = False):
        self.kernel = kernel
        self.comm_id = uuid.uuid4().hex
        self.inbox: list[dict] = []
        self.raw: list[dict] = []  # every message as sent
        self.meshes: list[dict] = []
        # JupyterLab 4.4+ sends comm messages on a subshell of their own (commsOverSubshells): heard
        # while a cell runs on the main shell
        self.subshell_id = self._create_subshell() if subshell else None
        self._send("comm_open", {"comm_id": self.comm_id, "target_name": TARGET, "data": {}})

    def _create_subshell(self) -> str:
        kc = self.kernel.kc
        msg = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(msg)
        while True:
            reply = kc.get_control_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]["subshell_id"]

    def _send(self, msg_type: str, content: dict) -> None:
        kc = self.kernel.kc
        msg = kc.session.msg(msg_type, content)
        if self.subshell_id is not None:
            msg["header"]["subshell_id"] = self.subshell_id
        kc.shell_channel.send(msg)

    def request(self, data: dict) -> None:
        self._send("comm_msg", {"comm_id": self.comm_id, "data": data})

    def wait_for(self, predicate, timeout: float = 10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for data in self.inbox:
                if predicate(data):
                    return data
            try:
                msg = self.kernel.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == self.comm_id:
                self.receive(msg["content"]["data"])
        raise TimeoutError(f"nothing matched within {timeout} s; got {self.inbox[-3:]}")

    def receive(self, data: dict) -> None:
        """Keep the picture of the meshes as the panel does: a "ranks" message patches it, and is
        also filed as the "meshes" message it amounts to (so tests look at what the panel shows)."""
        self.raw.append(data)
        if data.get("type") == "meshes":
            self.meshes = copy.deepcopy(data["meshes"])
        elif data.get("type") == "ranks":
            if not self.meshes:  # a change that came before the first list reached this panel: nothing to patch
                return
            for mesh in self.meshes:
                changed = {r["rank"]: r for r in data["changes"].get(mesh["name"], [])}
                mesh["ranks"] = [changed.get(r["rank"], r) for r in mesh["ranks"]]
            data = {"type": "meshes", "meshes": copy.deepcopy(self.meshes), "patched": True}
        self.inbox.append(data)

    def close(self) -> None:
        self._send("comm_close", {"comm_id": self.comm_id, "data": {}})


@pytest.fixture(scope="module")
def kernel():
    yield from kernel_with("%load_ext monarch_kernel\n%mesh up local --gpus 2 --dist none --name side")


def meshes_with(predicate):
    return lambda d: d.get("type") == "meshes" and predicate(d["meshes"])


def test_opening_the_comm_lists_the_meshes(kernel):
    panel = Panel(kernel)
    try:
        first = panel.wait_for(lambda d: d.get("type") == "meshes")
        assert first["version"] == 1
        assert set(first["colours"]) >= {"idle", "busy", "dead", "unresponsive"}  # the mesh widget's
        (mesh,) = first["meshes"]
        assert mesh["name"] == "side" and mesh["kind"] == "local" and mesh["shape"] == {"hosts": 1, "gpus": 2}
        assert mesh["dist"] == "none" and mesh["state"] == "up" and mesh["default"] is True
        assert [r["rank"] for r in mesh["ranks"]] == [0, 1] and {r["state"] for r in mesh["ranks"]} == {"idle"}
    finally:
        panel.close()


def test_busy_ranks_are_pushed_and_interrupt_ends_a_background_run(kernel):
    panel = Panel(kernel)
    try:
        panel.wait_for(lambda d: d.get("type") == "meshes")
        run = kernel.execute("from monarch_kernel.magics import current_mesh\n"
                             "fut = current_mesh().run_async('import time\\ntime.sleep(60)', name='nap')", 30)
        assert run.status == "ok", run.text()
        busy = panel.wait_for(meshes_with(lambda ms: all(r["state"] == "busy" for r in ms[0]["ranks"])), 5)
        detail = busy["meshes"][0]["ranks"][0]["detail"]
        assert detail.startswith("nap for")
        # while busy, "nap for N s" keeps moving (sent with the loads, every 2 s)
        panel.wait_for(meshes_with(lambda ms: ms[0]["ranks"][0]["detail"] not in (detail, "")), 5)
        start = time.monotonic()
        panel.request({"type": "action", "action": "interrupt", "mesh": "side"})
        result = panel.wait_for(lambda d: d.get("type") == "result" and d.get("action") == "interrupt")
        assert result["ok"] and "interrupted" in result["message"]
        panel.wait_for(meshes_with(lambda ms: all(r["state"] == "idle" for r in ms[0]["ranks"])), 5)
        assert time.monotonic() - start < 5
        done = kernel.execute("try:\n    fut.get()\nexcept KeyboardInterrupt as e:\n    print('stopped:', type(e).__name__)")
        assert "stopped: MeshInterrupted" in done.text()
    finally:
        panel.close()


def test_why_says_where_the_ranks_of_a_running_cell_are(kernel):
    panel = Panel(kernel)
    try:
        panel.wait_for(lambda d: d.get("type") == "meshes")
        run = kernel.execute("from monarch_kernel.magics import current_mesh\n"
                             "fut = current_mesh().run_async('import time\\ntime.sleep(60)', name='nap')", 30)
        assert run.status == "ok", run.text()
        panel.wait_for(meshes_with(lambda ms: all(r["state"] == "busy" for r in ms[0]["ranks"])), 5)
        panel.request({"type": "action", "action": "why", "mesh": "side"})
        result = panel.wait_for(lambda d: d.get("type") == "result" and d.get("action") == "why")
        assert result["ok"], result
        assert result["message"] == "no rank is inside a collective: ranks 0-1 at nap line 2  time.sleep(60)"
        assert "ranks 0-1 (main thread, running nap)" in result["why"]
        panel.request({"type": "action", "action": "interrupt", "mesh": "side"})
        panel.wait_for(meshes_with(lambda ms: all(r["state"] == "idle" for r in ms[0]["ranks"])), 5)
    finally:
        panel.close()


def test_only_the_ranks_that_changed_travel(kernel):
    panel = Panel(kernel)
    try:
        panel.wait_for(meshes_with(lambda ms: ms and all(r["state"] == "idle" for r in ms[0]["ranks"])))
        run = kernel.execute("from monarch_kernel.magics import current_mesh\n"
                             "one = current_mesh().slice(gpus=1).run_async('import time\\ntime.sleep(2)', name='one')",
                             30)
        assert run.status == "ok", run.text()
        panel.wait_for(meshes_with(lambda ms: [r["state"] for r in ms[0]["ranks"]] == ["idle", "busy"]), 5)
        delta = next(d for d in panel.raw if d.get("type") == "ranks" and any(
            r["state"] == "busy" for r in d["changes"].get("side", [])))
        assert [r["rank"] for r in delta["changes"]["side"]] == [1]  # rank 0 did not change: it stayed home
        panel.wait_for(meshes_with(lambda ms: all(r["state"] == "idle" for r in ms[0]["ranks"])), 10)
    finally:
        panel.close()


def test_logs_restart_down_and_bad_requests(kernel):
    panel = Panel(kernel)
    try:
        kernel.execute("%%mesh\nprint('hello from', __import__('os').environ['RANK'])")
        panel.request({"type": "action", "action": "logs", "mesh": "side", "rank": 1})
        logs = panel.wait_for(lambda d: d.get("action") == "logs")
        assert logs["rank"] == 1 and ["stdout", "hello from 1"] in logs["logs"]
        panel.request({"type": "action", "action": "restart", "mesh": "nope"})
        bad = panel.wait_for(lambda d: d.get("action") == "restart")
        assert not bad["ok"] and "nope" in bad["message"]
        panel.request({"type": "bogus"})
        assert not panel.wait_for(lambda d: "unknown request" in d.get("message", ""))["ok"]
        pids = [r["pid"] for r in panel.wait_for(meshes_with(lambda ms: ms))["meshes"][0]["ranks"]]
        panel.request({"type": "action", "action": "restart", "mesh": "side"})
        assert panel.wait_for(lambda d: d.get("action") == "restart" and d.get("ok"), 30)
        fresh = panel.wait_for(meshes_with(lambda ms: [r["pid"] for r in ms[0]["ranks"]] != pids
                                           and all(r["state"] == "idle" for r in ms[0]["ranks"])), 10)
        assert len(fresh["meshes"][0]["ranks"]) == 2
        panel.request({"type": "action", "action": "down", "mesh": "side"})
        assert panel.wait_for(lambda d: d.get("action") == "down")["ok"]
        panel.wait_for(meshes_with(lambda ms: ms == []), 5)
    finally:
        panel.close()


def test_loading_the_extension_announces_itself_to_open_panels():
    # a panel that found no monarch_kernel in this kernel links up when this comm arrives
    for kernel in kernel_with("import os"):
        run = kernel.execute("%load_ext monarch_kernel")
        assert run.status == "ok", run.text()
        opens = [m["content"] for _, m in run.messages if m["msg_type"] == "comm_open"]
        assert [(c["target_name"], c["data"]) for c in opens] == [(TARGET, {"type": "loaded"})]
        # the panel then opens its own comm: it works, and lists no mesh yet
        panel = Panel(kernel)
        assert panel.wait_for(lambda d: d.get("type") == "meshes")["meshes"] == []
        panel.close()


def test_malformed_requests_get_an_error_reply(kernel):
    """F20: a request that was not a JSON object raised in the kernel and got no answer."""
    panel = Panel(kernel)
    try:
        panel.wait_for(lambda d: d.get("type") == "meshes")
        for data in ("just a string", [1, 2], {"no": "type"}):
            panel.request(data)
        for shown in ("'str'", "'list'", "'dict'"):
            reply = panel.wait_for(lambda d, s=shown: d.get("type") == "result" and s in d.get("message", ""))
            assert reply["ok"] is False and "unknown request" in reply["message"]
    finally:
        panel.close()


def test_panels_that_vanish_without_closing_leave_no_thread_behind(kernel):
    """F20: every page reload left a thread snapshotting every mesh twice a second, forever."""
    panels = [Panel(kernel) for _ in range(20)]  # reloads: none of them closes its comm
    for panel in panels:
        panel.wait_for(lambda d: d.get("type") == "meshes")
    count = "import threading\nprint(sum(t.name.startswith('mesh-sidebar') for t in threading.enumerate()))"
    from conftest import wait_until

    from monarch_kernel.magics.sidebar import MAX_OPEN_CHANNELS

    assert wait_until(lambda: int(kernel.execute(count).text().strip()) <= 2 * MAX_OPEN_CHANNELS, 10)
    newest = panels[-1]
    newest.request({"type": "refresh"})
    newest.inbox.clear()
    newest.wait_for(lambda d: d.get("type") == "meshes")  # the newest panels still work
