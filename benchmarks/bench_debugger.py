"""JupyterLab's debugger on a rank: what tracing costs a rank, and how fast the panels answer.

Driven through a real kernel as JupyterLab drives it (DAP on the control channel; `tests/dap_client.py`),
on a 2-rank local mesh, rank 0 debugged:

1. A pure-Python loop in a `%%mesh` cell, timed inside each rank, in the same runs: rank 0 traced
   by the debugger and rank 1 not (same cell, same moment); the cell's file with a breakpoint
   (never hit: pydevd traces the file line by line) and without (only calls are looked at); then
   with the debugger off again (rank 0 must be back to rank 1's speed).
2. The panels' requests while rank 0 is paused at a breakpoint (stackTrace, scopes, variables:
   what JupyterLab sends on each stop), against the same requests to the kernel's own debugger
   paused in a plain cell (the floor: ipykernel and debugpy with no mesh in between).

    .venv/bin/python benchmarks/bench_debugger.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

LOOP = """%%mesh
import os, time
def work(n):
    total = 0
    for i in range(n):
        total += i % 7
    return total
started = time.perf_counter()
work(400_000)
print("took", os.environ["RANK"], time.perf_counter() - started)
if os.environ.get("NEVER"):
    pass
"""
NEVER_LINE = 12  # the `pass` above: a breakpoint there is never hit, but makes the file traced line by line
PAUSE = """%%mesh
import os
x = 10 * int(os.environ["RANK"])
y = x + 1
"""
PLAIN = "a = 1\nb = a + 1\n"


def loop_times(dap, code: str) -> dict[int, float]:
    run = dap.finish(dap.start_cell(code), 300)
    assert run.status == "ok", run.text()
    return {int(r): float(s) for r, s in re.findall(r"took (\d) ([0-9.e-]+)", run.text())}


def ask(kc, seq: int, command: str, **arguments) -> dict:
    """One DAP request on the control channel, its response read at once (no polling interval)."""
    msg = kc.session.msg("debug_request", {"seq": seq, "type": "request", "command": command, "arguments": arguments})
    kc.control_channel.send(msg)
    while True:
        reply = kc.get_control_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["content"]["success"], reply["content"]
            return reply["content"]["body"]


def requests_after_stop(kc, thread: int, rounds: int) -> list[float]:
    """Seconds for what JupyterLab asks at a stop: stackTrace, scopes, variables of the top frame."""
    out = []
    for i in range(rounds):
        started = time.perf_counter()
        frame = ask(kc, 10_000 + 3 * i, "stackTrace", threadId=thread)["stackFrames"][0]
        scope = ask(kc, 10_001 + 3 * i, "scopes", frameId=frame["id"])["scopes"][0]
        ask(kc, 10_002 + 3 * i, "variables", variablesReference=scope["variablesReference"])
        out.append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from dap_client import DapSession
    from kernel_driver import KernelDriver

    kernel = KernelDriver()
    try:
        up = kernel.execute("%load_ext monarch_kernel\n%mesh up local --gpus 2 --dist none\n%mesh debug rank 0", 180)
        assert up.status == "ok", up.text()
        dap = DapSession(kernel)
        rows: dict[str, list[float]] = {}

        def add(name: str, value: float) -> None:
            rows.setdefault(name, []).append(value)

        loop_times(dap, LOOP)  # warm-up
        for _ in range(args.rounds):
            off = loop_times(dap, LOOP)
            add("debugger off: rank 0 / rank 1", off[0] / off[1])
        dap.start_debugging()
        path = dap.break_at(LOOP, [NEVER_LINE])
        loop_times(dap, LOOP)  # (starts the rank's debugger)
        for _ in range(args.rounds):
            traced = loop_times(dap, LOOP)
            add("on, a breakpoint in the cell: rank 0 (traced) / rank 1", traced[0] / traced[1])
        assert dap.request("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)["success"]
        for _ in range(args.rounds):
            traced = loop_times(dap, LOOP)
            add("on, no breakpoint in the cell: rank 0 (traced) / rank 1", traced[0] / traced[1])

        dap.break_at(PAUSE, [4])
        run = dap.start_cell(PAUSE)
        stopped = dap.wait_event("stopped")
        rank_requests = requests_after_stop(kernel.kc, stopped["body"]["threadId"], args.rounds * 4)
        assert dap.request("continue", threadId=stopped["body"]["threadId"])["success"]
        dap.finish(run)
        dap.break_at(PLAIN, [2])
        heard = len(dap.events)
        run = dap.start_cell(PLAIN)
        stopped = dap.wait_event("stopped", after=heard)
        kernel_requests = requests_after_stop(kernel.kc, stopped["body"]["threadId"], args.rounds * 4)
        assert dap.request("continue", threadId=stopped["body"]["threadId"])["success"]
        dap.finish(run)
        dap.stop_debugging()
        for _ in range(args.rounds):
            after = loop_times(dap, LOOP)
            add("debugger off again: rank 0 / rank 1", after[0] / after[1])
    finally:
        kernel.shutdown()

    print(f"1. a pure-Python loop timed in each rank of the same cell (median of {args.rounds}):\n")
    print("| state | rank 0 / rank 1 |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f}x |")
    print("\n2. what JupyterLab asks at each stop (stackTrace + scopes + variables), median of "
          f"{len(rank_requests)}:\n")
    print("| paused in | ms | ratio |\n|---|---|---|")
    floor = statistics.median(kernel_requests)
    print(f"| the kernel (ipykernel's own debugger: the floor) | {floor * 1e3:.1f} | 1.00x |")
    print(f"| rank 0 of the mesh (through the kernel and the mesh's links) | "
          f"{statistics.median(rank_requests) * 1e3:.1f} | {statistics.median(rank_requests) / floor:.2f}x |")


if __name__ == "__main__":
    main()
