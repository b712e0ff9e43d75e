"""JupyterLab's debugger on a rank, driven through a real kernel exactly as JupyterLab drives it (DAP
over jupyter_client's control channel, events on IOPub), on a real local mesh."""

from __future__ import annotations

import pytest
from dap_client import DapSession
from kernel_driver import kernel_with

CELL = """%%mesh
import os
x = 10 * int(os.environ["RANK"])
y = x + 1
print("rank", os.environ["RANK"], "y", y)
"""


@pytest.fixture(scope="module")
def kernel():
    yield from kernel_with("%load_ext monarch_kernel\n%mesh up local --gpus 4 --dist gloo")


def test_a_breakpoint_in_a_mesh_cell_stops_the_chosen_rank_and_shows_its_variables(kernel):
    dap = DapSession(kernel)
    chosen = kernel.execute("%mesh debug rank 2")
    assert chosen.status == "ok" and "rank 2" in chosen.text(), chosen.text()
    dap.start_debugging()
    path = dap.break_at(CELL, [4])
    run = dap.start_cell(CELL)
    stopped = dap.wait_event("stopped")
    thread = stopped["body"]["threadId"]
    top, variables = dap.variables_of_top_frame(thread)
    assert top["source"]["path"] == path and top["line"] == 4, top
    assert variables["x"] == "20", variables  # rank 2's value
    assert "y" not in variables
    heard = len(dap.events)
    assert dap.request("next", threadId=thread)["success"]
    stopped = dap.wait_event("stopped", after=heard)
    top, variables = dap.variables_of_top_frame(stopped["body"]["threadId"])
    assert top["line"] == 5 and variables["y"] == "21", (top, variables)
    threads = dap.request("threads")["body"]["threads"]
    assert any(t["name"].startswith("rank 2:") for t in threads), threads
    assert dap.request("continue", threadId=thread)["success"]
    dap.finish(run)
    assert run.status == "ok", run.text()
    for rank in range(4):
        assert f"rank {rank} y {10 * rank + 1}" in run.text()
    assert dap.request("disconnect", restart=False, terminateDebuggee=True)["success"]
