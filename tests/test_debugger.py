"""JupyterLab's debugger on a rank, driven through a real kernel exactly as JupyterLab drives it (DAP
over jupyter_client's control channel, events on IOPub), on a real local mesh."""

from __future__ import annotations

import sys
import time

import pytest
from dap_client import DapSession
from jupyter_client.session import Session
from kernel_driver import kernel_with
from sshhosts import SSHTestHosts
from sshhosts import unavailable_reason as ssh_unavailable
from test_sidebar import Panel

CELL = """%%mesh
import os, torch
x = 10 * int(os.environ["RANK"])
t = torch.full((2, 3), float(x))
y = x + 1
print("rank", os.environ["RANK"], "y", y)
"""
STOP_LINE = 5  # y = x + 1


@pytest.fixture(scope="module")
def kernel():
    yield from kernel_with("%load_ext monarch_kernel\n%mesh up local --gpus 4 --dist gloo")


def test_a_breakpoint_in_a_mesh_cell_stops_the_chosen_rank_and_shows_its_variables(kernel):
    dap = DapSession(kernel)
    chosen = kernel.execute("%mesh debug rank 2")
    assert chosen.status == "ok" and "rank 2" in chosen.text(), chosen.text()
    dap.start_debugging()
    path = dap.break_at(CELL, [STOP_LINE])
    run = dap.start_cell(CELL)
    stopped = dap.wait_event("stopped")
    thread = stopped["body"]["threadId"]
    top, variables = dap.variables_of_top_frame(thread)
    assert top["source"]["path"] == path and top["line"] == STOP_LINE, top
    assert variables["x"] == "20", variables  # rank 2's value
    assert variables["t"] == "float32[2, 3] on cpu", variables  # a tensor as what it is, not its values
    assert "y" not in variables
    console = dap.request("evaluate", expression="x * 3 + t.sum().item()", frameId=top["id"], context="repl")
    assert console["success"] and console["body"]["result"] == "180.0", console  # the debug console, on rank 2
    heard = len(dap.events)
    assert dap.request("next", threadId=thread)["success"]
    stopped = dap.wait_event("stopped", after=heard)
    top, variables = dap.variables_of_top_frame(stopped["body"]["threadId"])
    assert top["line"] == STOP_LINE + 1 and variables["y"] == "21", (top, variables)
    threads = dap.request("threads")["body"]["threads"]
    assert any(t["name"].startswith("rank 2:") for t in threads), threads
    assert dap.request("continue", threadId=thread)["success"]
    dap.finish(run)
    assert run.status == "ok", run.text()
    for rank in range(4):
        assert f"rank {rank} y {10 * rank + 1}" in run.text()
    dap.stop_debugging()
    after = _run(dap, UNTRACED)  # the debugger off: rank 2 runs untraced again, pydevd's relay gone
    assert "[2] traced False relay False" in after.text(), after.text()


UNTRACED = """%%mesh --ranks 2
import sys, threading, time
relay = lambda: any(t.name == "rank-debug-relay" for t in threading.enumerate())
deadline = time.monotonic() + 10
while relay() and time.monotonic() < deadline:
    time.sleep(0.05)
print("traced", sys.gettrace() is not None, "relay", relay())
"""


def _run(dap: DapSession, code: str, timeout: float = 120):
    run = dap.finish(dap.start_cell(code), timeout)
    assert run.status == "ok", run.text()
    return run


class _SecondClient:
    """Another client of the same kernel, with its own session (its own socket identity: replies to one
    never reach the other), reading all of IOPub as each client does."""

    def __init__(self, kernel):
        ours = kernel.km.session
        self.kc = kernel.km.client()
        self.kc.session = Session(key=ours.key, signature_scheme=ours.signature_scheme, username="sidebar")
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=30)


def test_the_stop_button_ends_a_paused_cell_and_a_restarted_rank_stops_again(kernel):
    dap = DapSession(kernel)
    dap.start_debugging()
    _run(dap, "%mesh debug rank 1")
    dap.break_at(CELL, [STOP_LINE])
    run = dap.start_cell(CELL)
    dap.wait_event("stopped")
    heard = len(dap.events)
    kernel.interrupt()
    dap.finish(run, 30)
    assert run.status == "error" and "KeyboardInterrupt" in run.text(), run.text()
    dap.wait_event("continued", after=heard)
    after = _run(dap, "%%mesh\nprint('after the stop', 7)")
    assert "[0-3] after the stop 7" in after.text(), after.text()  # every rank ran it
    _run(dap, "%mesh restart")
    heard = len(dap.events)
    run = dap.start_cell(CELL)
    stopped = dap.wait_event("stopped", after=heard)
    _, variables = dap.variables_of_top_frame(stopped["body"]["threadId"])
    assert variables["x"] == "10", variables  # rank 1's value, in its new process
    assert dap.request("continue", threadId=stopped["body"]["threadId"])["success"]
    assert dap.finish(run).status == "ok", run.text()
    dap.stop_debugging()


COLLECTIVE = """%%mesh
import os, torch, torch.distributed as dist
t = torch.ones(1) * int(os.environ["RANK"])
dist.all_reduce(t)
print("sum", t.item())
"""


def test_ranks_waiting_for_a_paused_rank_are_said_to_wait_for_the_debugger_not_to_hang(kernel):
    dap = DapSession(kernel)
    sidebar = _SecondClient(kernel)  # (ready before the cell: a busy kernel answers no kernel_info)
    dap.start_debugging()
    _run(dap, "%mesh debug rank 3\n%mesh config hang 1")
    try:
        dap.break_at(COLLECTIVE, [4])
        run = dap.start_cell(COLLECTIVE)
        stopped = dap.wait_event("stopped")
        deadline = time.monotonic() + 60
        while "rank 3 paused in the debugger" not in run.text():
            assert time.monotonic() < deadline, run.text()
            dap.pump(0.2)
        assert "no progress" not in run.text(), run.text()
        panel = Panel(sidebar, subshell=True)  # the sidebar's Why? while rank 3 is paused (the cell runs)
        try:
            name = panel.wait_for(lambda d: d.get("type") == "meshes" and d["meshes"])["meshes"][0]["name"]
            panel.request({"type": "action", "action": "why", "mesh": name})
            why = panel.wait_for(lambda d: d.get("action") == "why", 60)
            assert why["ok"] and why["why"].startswith("rank 3 paused in the debugger"), why
            assert "ranks 0-2 wait in all_reduce" in why["why"], why  # and the verdict as it stands
        finally:
            panel.close()
        assert dap.request("continue", threadId=stopped["body"]["threadId"])["success"]
        dap.finish(run)
        assert run.status == "ok" and "sum 6.0" in run.text(), run.text()
    finally:
        sidebar.kc.stop_channels()
        _run(dap, "%mesh config hang 30")
        dap.stop_debugging()


PLAIN = """a = 1
b = a + 1
print("plain", b)
"""


def test_a_plain_cell_is_debugged_in_the_kernel_as_before(kernel):
    dap = DapSession(kernel)
    dap.start_debugging()
    path = dap.break_at(PLAIN, [2])
    run = dap.start_cell(PLAIN)
    stopped = dap.wait_event("stopped")
    thread = stopped["body"]["threadId"]
    assert thread < 1 << 32  # the kernel's own thread
    top, variables = dap.variables_of_top_frame(thread)
    assert top["source"]["path"] == path and top["line"] == 2, top
    assert dap.request("continue", threadId=thread)["success"]
    assert dap.finish(run).status == "ok" and "plain 2" in run.text(), run.text()
    dap.stop_debugging()


ACTOR = """from monarch_kernel import Actor, endpoint
from monarch_kernel.magics import current_mesh

class Counter(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def add(self, k):
        self.n += k
        return self.n
"""


def test_a_breakpoint_in_an_actor_endpoint_stops_the_chosen_rank(kernel):
    dap = DapSession(kernel)
    dap.start_debugging()
    dap.break_at(ACTOR, [10])
    _run(dap, ACTOR)
    _run(dap, "%mesh debug rank 2")
    _run(dap, "counters = current_mesh().spawn('debugged_counters', Counter)")
    run = dap.start_cell("print(sorted(counters.add.call(5).get().values()))")
    stopped = dap.wait_event("stopped")
    thread = stopped["body"]["threadId"]
    assert thread >= 3 << 32, stopped  # rank 2's
    top, variables = dap.variables_of_top_frame(thread)
    assert top["line"] == 10 and top["name"] == "add" and variables["k"] == "5", (top, variables)
    assert dap.request("continue", threadId=thread)["success"]
    assert dap.finish(run).status == "ok" and "[5, 5, 5, 5]" in run.text(), run.text()
    dap.stop_debugging()


def test_the_meshes_sidebar_chooses_the_rank_the_debugger_stops_in(kernel):
    sidebar = _SecondClient(kernel)
    panel = Panel(sidebar)
    dap = DapSession(kernel)
    try:
        dap.start_debugging()
        name = panel.wait_for(lambda d: d.get("type") == "meshes" and d["meshes"])["meshes"][0]["name"]
        panel.request({"type": "action", "action": "debug", "mesh": name, "rank": 3})
        chosen = panel.wait_for(lambda d: d.get("action") == "debug", 60)
        assert chosen["ok"] and "rank 3" in chosen["message"] and "it is on" in chosen["message"], chosen
        panel.wait_for(lambda d: d.get("type") == "meshes" and d["meshes"][0]["debugged"] == 3, 10)
        dap.break_at(CELL, [STOP_LINE])
        run = dap.start_cell(CELL)
        stopped = dap.wait_event("stopped")
        _, variables = dap.variables_of_top_frame(stopped["body"]["threadId"])
        assert variables["x"] == "30", variables
        assert dap.request("continue", threadId=stopped["body"]["threadId"])["success"]
        assert dap.finish(run).status == "ok", run.text()
        panel.request({"type": "action", "action": "debug", "mesh": name, "rank": 9})
        refused = panel.wait_for(lambda d: d.get("action") == "debug" and not d["ok"], 10)
        assert "no rank 9" in refused["message"], refused
    finally:
        panel.close()
        dap.stop_debugging()
        sidebar.kc.stop_channels()


FAILING = """%%mesh
import os
r = int(os.environ["RANK"])
if r in (1, 3):
    oops = {"rank": r}
    raise ValueError(f"bad rank {r}")
print("fine", r)
"""


def test_post_mortem_opens_the_first_failed_ranks_error_in_the_debugger(kernel):
    dap = DapSession(kernel)
    dap.start_debugging()
    failed = dap.finish(dap.start_cell(FAILING))
    assert failed.status == "error" and "bad rank 1" in failed.text(), failed.text()
    heard = len(dap.events)
    run = dap.start_cell("%mesh debug post-mortem")
    stopped = dap.wait_event("stopped", after=heard)
    thread = stopped["body"]["threadId"]
    assert thread >= 2 << 32 and thread < 3 << 32, stopped  # rank 1's, the first that failed
    top, variables = dap.variables_of_top_frame(thread)
    assert top["line"] == 6 and variables["r"] == "1" and "oops" in variables, (top, variables)
    assert dap.request("continue", threadId=thread)["success"]
    dap.finish(run)
    assert run.status == "ok" and "rank 1 of mesh" in run.text(), run.text()
    refused = dap.finish(dap.start_cell("%mesh debug post-mortem 2"))
    assert refused.status == "error" and "did not fail; these did: 1,3" in refused.text(), refused.text()
    dap.stop_debugging()


@pytest.fixture(scope="module")
def ssh_kernel(tmp_path_factory):
    reason = ssh_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with SSHTestHosts(2, str(tmp_path_factory.mktemp("ssh"))) as hosts:
        home = hosts.install_home(str(tmp_path_factory.mktemp("home")))
        setup = (f"%load_ext monarch_kernel\n%mesh up ssh host-0 host-1 --gpus 2 --dist gloo "
                 f"--python {sys.executable} --name far")
        yield from kernel_with(setup, extra_env={"HOME": home})


def test_a_rank_on_another_host_stops_at_the_breakpoint(ssh_kernel):
    dap = DapSession(ssh_kernel)
    _run(dap, "%mesh debug rank 3")  # host-1's second rank
    dap.start_debugging()
    dap.break_at(CELL, [STOP_LINE])
    run = dap.start_cell(CELL)
    stopped = dap.wait_event("stopped", timeout=120)
    thread = stopped["body"]["threadId"]
    assert thread >= 4 << 32, stopped
    top, variables = dap.variables_of_top_frame(thread)
    assert top["line"] == STOP_LINE and variables["x"] == "30", (top, variables)
    threads = dap.request("threads")["body"]["threads"]
    assert any(t["name"].startswith("rank 3:") for t in threads), threads
    assert dap.request("continue", threadId=thread)["success"]
    dap.finish(run, 120)
    assert run.status == "ok" and "rank 3 y 31" in run.text(), run.text()
    dap.stop_debugging()


HELPER = '''def double(v):
    w = v * 2
    return w
'''


def test_a_breakpoint_in_a_synced_project_file_stops_the_rank_in_its_hosts_copy(ssh_kernel, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "dbg_helper.py").write_text(HELPER)
    dap = DapSession(ssh_kernel)
    _run(dap, f"%mesh sync {project}\n%mesh debug rank 2")  # host-1's first rank: a copy elsewhere on that host
    where = _run(dap, "%%mesh --ranks 2\nimport dbg_helper\nprint('at', dbg_helper.__file__)").text()
    assert str(project) not in where, where  # the rank imports the host's copy, not the notebook's file
    dap.start_debugging()
    local = str(project / "dbg_helper.py")
    answer = dap.request("setBreakpoints", source={"path": local}, breakpoints=[{"line": 2}], sourceModified=False)
    assert answer["success"], answer
    assert dap.request("configurationDone")["success"]
    run = dap.start_cell("%%mesh\nimport dbg_helper\nprint('doubled', dbg_helper.double(21))")
    stopped = dap.wait_event("stopped", timeout=120)
    thread = stopped["body"]["threadId"]
    top, variables = dap.variables_of_top_frame(thread)
    assert top["source"]["path"] == local and top["line"] == 2 and variables["v"] == "21", (top, variables)
    assert dap.request("continue", threadId=thread)["success"]
    dap.finish(run, 120)
    assert run.status == "ok" and "doubled 42" in run.text(), run.text()
    dap.stop_debugging()
