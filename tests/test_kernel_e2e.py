"""A real Jupyter kernel driven like a notebook frontend (jupyter_client)."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import pids_alive, wait_until
from kernel_driver import KernelDriver, kernel_with

pytestmark = pytest.mark.slow

PIDS = ("from monarch_kernel.magics import current_registry\n"
        "_m = current_registry().get()\n"
        "print(json.dumps([s.pid for s in _m.status()] + [l.host.pid for l in _m._runtime.links]))")


@pytest.fixture(scope="module")
def kernel():
    yield from kernel_with("import json\n%load_ext monarch_kernel\n%mesh up local --gpus 4 --dist gloo")


def first_output_time(run, needle):
    for ts, msg in run.messages:
        data = msg["content"].get("data", {}) or {}
        if needle in data.get("text/plain", "") or needle in msg["content"].get("text", ""):
            return ts - run.started
    return None


def test_output_streams_live_into_its_own_cell_deduped(kernel):
    run = kernel.execute("%%mesh\nimport time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')", 30)
    assert run.status == "ok"
    first, second = first_output_time(run, "first"), first_output_time(run, "second")
    assert first is not None and second is not None and second - first > 1.5
    outputs = run.outputs()
    assert len(outputs) == 2  # one live display, updated in place, then the per-rank timing
    assert outputs[0]["data"]["text/plain"] == "[0-3] first\n[0-3] second"
    timing = outputs[1]["data"]["text/plain"].splitlines()
    assert timing[0].startswith("In[") and "per rank: median 2.0" in timing[0]
    assert [line.split()[0] for line in timing[1:]] == [f"localhost:{r}" for r in range(4)]
    assert "application/vnd.jupyter.widget-view+json" in outputs[1]["data"]  # a widget, text as fallback
    after = kernel.execute("1 + 1")
    assert "first" not in after.text() and "second" not in after.text()


def test_timing_and_errors_name_the_cell_by_the_prompt_the_notebook_shows(kernel):
    for code in ("%%mesh\nimport time\ntime.sleep(0.3)", "%%mesh\nraise ValueError('boom')"):
        run = kernel.execute(code, 30)
        prompt = run.reply["content"]["execution_count"]  # the [N] the frontend shows beside the cell
        text = run.text()
        assert f"In[{prompt}]" in text, (prompt, text)
        assert f"In[{prompt + 1}]" not in text, (prompt, text)


def test_progress_bars_update_in_place_while_the_cell_runs(kernel):
    code = ("%%mesh\nimport sys, time\nfor i in range(1, 21):\n"
            "    print(f'\\rtrain {i * 5}%', end='', file=sys.stderr, flush=True)\n    time.sleep(0.1)\n"
            "print(file=sys.stderr)\nprint('done')")
    run = kernel.execute(code, 30)
    assert run.status == "ok"
    shown = [m["content"]["data"]["text/plain"] for _, m in run.messages
             if m["msg_type"] in ("display_data", "update_display_data")
             and "train" in m["content"]["data"].get("text/plain", "")]
    assert any("train 50%" in text for text in shown[:-1])  # the bar moved while the cell ran
    assert not any("\r" in text for text in shown)
    final = run.outputs()[0]["data"]["text/plain"]
    assert "[0-3]:train 100%" in final and "train 50%" not in final and "[0-3] done" in final


def test_input_on_the_ranks_is_asked_once_in_the_notebook(kernel):
    run = kernel.execute("%%mesh\nname = input('your name? ')\nname.upper()", 30, answers=["ada"])
    assert run.status == "ok" and run.prompts == ["[ranks 0-3] your name? "]
    assert "all ranks: 'ADA'" in run.text() and run.masked == []
    secret = kernel.execute("%%mesh\nimport getpass\nlen(getpass.getpass('token? '))", 30, answers=["s3cret"])
    assert len(secret.masked) == 1 and "all ranks: 6" in secret.text()
    # F28: a masked box is a program on the hosts asking; it says so, and for which mesh
    assert secret.masked[0].startswith("[ranks 0-3 of mesh ") and "what you type goes to those ranks" in secret.masked[0]
    assert secret.masked[0].endswith("] token? ")
    assert "s3cret" not in secret.text()


def test_breakpoint_gives_pdb_on_the_ranks_in_the_notebook(kernel):
    code = "%%mesh\nimport os\nr = int(os.environ['RANK'])\nbreakpoint()\nr * 10"
    run = kernel.execute(code, 30, answers=["p r * 100", "c"])
    assert run.status == "ok", run.text()
    assert run.prompts == ["[ranks 0-3] (Pdb) "] * 2  # one box drives the debugger on every rank
    text = run.text()
    assert all(f"[{r}] {r * 100}" in text for r in range(4))
    assert text.index("[1] 100") < text.index("[2] 200")  # rank-specific lines in rank order
    single = kernel.execute("%%mesh --ranks 2\nx = 41\nbreakpoint()\nx += 1\nx", 30, answers=["p x", "c"])
    assert single.prompts == ["[rank 2] (Pdb) "] * 2 and "[2] 41" in single.text() and "42" in single.text()


def test_stop_while_the_ranks_wait_for_input_ends_the_cell(kernel):
    run = kernel.submit("%%mesh\ninput('never answered? ')")
    request = kernel.kc.get_stdin_msg(timeout=20)
    assert request["content"]["prompt"] == "[ranks 0-3] never answered? "
    stopped = time.monotonic()
    kernel.interrupt()
    kernel.collect(run, 15)
    assert run.status == "error" and time.monotonic() - stopped < 5
    assert kernel.execute("%%mesh\n1 + 1").status == "ok"


def test_mesh_debug_opens_pdb_where_the_last_cell_failed(kernel):
    failing = kernel.execute("%%mesh\nimport os\ndef step(r):\n    scale = r * 7\n    if r % 2:\n"
                             "        raise ValueError('bad rank')\n    return scale\nstep(int(os.environ['RANK']))", 30)
    assert failing.status == "error"
    run = kernel.execute("%mesh debug", 30, answers=["p scale", "q"])
    assert run.status == "ok", run.text()
    assert run.prompts == ["[ranks 1,3] (Pdb) "] * 2  # only the ranks that failed, at the raise
    assert "[1] 7" in run.text() and "[3] 21" in run.text()
    kernel.execute("%%mesh\npass")
    assert "no rank of mesh" in kernel.execute("%mesh debug", 30).text()


def test_values_and_allreduce_as_in_the_readme(kernel):
    run = kernel.execute("%%mesh\nimport torch, torch.distributed as dist\nt = torch.ones(2) * dist.get_rank()\n"
                         "dist.all_reduce(t)\nprint('sum', t.tolist())\ndist.get_rank()", 30)
    text = run.text()
    assert text.count("sum [6.0, 6.0]") == 1 and "[0-3] sum [6.0, 6.0]" in text
    result = [o for o in run.outputs() if o["type"] == "execute_result"][0]
    assert "gpus 0  gpus 1  gpus 2  gpus 3" in result["data"]["text/plain"]
    assert "<table>" in result["data"]["text/html"]


def _interrupted_while_running(kernel, code: str, started=lambda run: "napping" in run.text()):
    """Run `code`, press stop once started(run) holds; (the run, seconds from stop to its end)."""
    run = kernel.submit(code)
    kernel.collect(run, 30, until=started)
    start = time.monotonic()
    kernel.interrupt()
    kernel.collect(run, 10)
    return run, time.monotonic() - start


def test_stop_button_interrupts_every_rank_within_a_second(kernel):
    kernel.execute("%%mesh\nkept = 'state'")
    run, seconds = _interrupted_while_running(kernel, "%%mesh\nimport time\nprint('napping', flush=True)\n"
                                                      "time.sleep(100)")
    assert seconds < 1.0
    assert run.status == "error"
    error = [o for o in run.outputs() if o["type"] == "error"][0]
    tb = "\n".join(error["traceback"])
    assert "KeyboardInterrupt" in tb and "time.sleep(100)" in tb and "ranks 0-3" in tb
    start = time.monotonic()
    after = kernel.execute("%%mesh\nkept", 10)
    assert time.monotonic() - start < 1.0
    assert "all ranks: 'state'" in after.text()
    busy = kernel.execute("%mesh status").text()
    assert busy.count("idle") == 4


def test_stop_button_while_waiting_on_an_actor_stops_the_endpoint(kernel, tmp_path):
    defined = kernel.execute(
        "import os, time\nfrom monarch_kernel import Actor, endpoint\nfrom monarch_kernel.magics import current_mesh\n"
        "class Sleeper(Actor):\n    @endpoint\n    def nap(self, s, marker=None):\n        if marker:\n"
        "            open(f'{marker}-{os.environ[\"RANK\"]}', 'w').close()\n        time.sleep(s)\n        return 'rested'\n"
        "sleepers = current_mesh().spawn('sleepers', Sleeper)", 30)
    assert defined.status == "ok", defined.text()
    marker = tmp_path / "napping"  # the endpoints run once each rank made its file
    run, seconds = _interrupted_while_running(kernel, f"sleepers.nap.call(100, {str(marker)!r}).get()",
                                              lambda run: len(list(tmp_path.glob("napping-*"))) == 4)
    assert seconds < 2.0
    error = "\n".join([o for o in run.outputs() if o["type"] == "error"][0]["traceback"])
    assert "Sleeper.nap" in error and "KeyboardInterrupt" in error and "time.sleep(s)" in error  # notebook source
    after = kernel.execute("sleepers.nap.call(0).get()", 10)
    assert "all ranks: 'rested'" in after.text()


def _descendants(pid):
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children] + [d for c in children for d in _descendants(int(c))]


def test_stop_button_during_mesh_up_leaves_nothing_running(kernel):
    before = set(_descendants(kernel.pid))
    run = kernel.submit("%mesh up local --gpus 4 --dist gloo --name stopped")
    kernel.collect(run, 10, until=lambda r: any(m["msg_type"] == "execute_input" for _, m in r.messages))
    # stop once the agent is up (it forks the ranks next)
    assert wait_until(lambda: set(_descendants(kernel.pid)) - before, 20)
    kernel.interrupt()
    kernel.collect(run, 30)
    assert run.status == "error"
    assert "starting mesh 'stopped' was interrupted; nothing of it is left running" in run.text()
    assert "Traceback" not in run.text()
    deadline = time.monotonic() + 5
    while pids_alive(set(_descendants(kernel.pid)) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pids_alive(set(_descendants(kernel.pid)) - before)
    assert "stopped" not in kernel.execute("%mesh status").text()
    assert kernel.execute("%%mesh\n1 + 1").status == "ok"  # the default mesh is untouched


def test_dead_rank_ends_the_cell_within_a_second_with_fail_fast(kernel):
    start_cell = ("%%mesh --fail-fast\nimport os, sys, time\nif os.environ['RANK'] == '2':\n"
                  "    print('bye', file=sys.stderr, flush=True)\n    time.sleep(0.2)\n    os._exit(3)\ntime.sleep(30)")
    run = kernel.submit(start_cell)
    start = time.monotonic()
    kernel.collect(run, 15)
    assert time.monotonic() - start < 2.0
    tb = "\n".join([o for o in run.outputs() if o["type"] == "error"][0]["traceback"])
    assert "rank 2 (host localhost, pid" in tb and "exit code 3" in tb and "bye" in tb
    status = kernel.execute("%mesh status").text()
    assert "dead" in status and "exit code 3" in status
    restarted = kernel.execute("%mesh restart", 60)
    assert restarted.text().count("idle") == 4


def test_background_run_keeps_its_output_in_its_cell(kernel):
    bg = kernel.execute("%%mesh --bg\nimport time\ntime.sleep(0.5)\nprint('late line')\n5", 10)
    assert bg.status == "ok" and "MeshFuture" in bg.text()
    widget_ids = {m["content"]["comm_id"] for _, m in bg.messages if m["msg_type"] == "comm_open"}
    assert any("Output widget" in o.get("data", {}).get("text/plain", "") or
               "application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in bg.outputs())
    later = kernel.submit("import time\ntime.sleep(1.5)\nprint('other cell')")
    updates = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        msg = kernel.kc.get_iopub_msg(timeout=5)
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] in widget_ids:
            updates.append(json.dumps(msg["content"]["data"]))
        if msg["parent_header"].get("msg_id") == later.msg_id:
            later.messages.append((time.monotonic(), msg))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    later.reply = kernel.reply_to(later.msg_id, 10)
    assert any("late line" in u for u in updates)  # into the bg cell's widget
    assert "late line" not in later.text() and "other cell" in later.text()
    waited = kernel.execute("await _", 10)
    assert "all ranks: 5" in waited.text()


@pytest.mark.parametrize("how", ["SIGKILL", "restart", "shutdown"])
def test_the_kernel_going_away_leaves_no_process_or_folder_behind(how):
    """After a SIGKILL of the kernel, the mesh's folders stayed, and helpers in sessions of their own ran on."""
    k = KernelDriver()
    try:
        run = k.execute("import json\n%load_ext monarch_kernel\n%mesh up local --gpus 2 --dist gloo\n" + PIDS, 120)
        pids = json.loads([o for o in run.outputs() if o["type"] == "stream"][-1]["text"].strip().splitlines()[-1])
        assert len(pids_alive(pids)) == 3  # two ranks and their host agent
        # what the ranks start (subprocesses, DataLoader workers, daemons in a session of their own) must go too
        helpers = k.execute("_h = current_registry().get().run(\"import subprocess\\n"
                            "[subprocess.Popen(['sleep', '300']).pid, "
                            "subprocess.Popen(['sleep', '301'], start_new_session=True).pid]\")\n"
                            "print(json.dumps([p for v in _h.values() for p in v]))", 60)
        pids += json.loads(helpers.text().strip().splitlines()[-1])
        assert len(pids_alive(pids)) == 7
        shown = k.execute("_s = current_registry().get()._runtime.state\nprint(json.dumps([_s.run_dir, _s.shm_dir]))", 30)
        folders = json.loads(shown.text().strip().splitlines()[-1])
        assert all(os.path.isdir(f) for f in folders)
        if how == "SIGKILL":
            k.kill()
        elif how == "restart":
            k.km.restart_kernel(now=False)
        else:
            k.km.shutdown_kernel(now=False)
        assert wait_until(lambda: not pids_alive(pids) and not any(os.path.exists(f) for f in folders), 10), (
            pids_alive(pids), [f for f in folders if os.path.exists(f)])
    finally:
        k.shutdown()


def test_monarch_kernelspec_loads_the_extension(tmp_path, monkeypatch):
    subprocess.run([sys.executable, "-m", "monarch_kernel", "install", "--prefix", str(tmp_path)], check=True)
    spec = json.loads((tmp_path / "share/jupyter/kernels/monarch/kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (monarch)" and "--ext=monarch_kernel" in spec["argv"]
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share/jupyter"))
    k = KernelDriver(kernel_name="monarch")
    try:
        run = k.execute("%mesh up local --gpus 1 --dist none\n%mesh down", 60)
        assert run.status == "ok" and "is down" in run.text()
    finally:
        k.shutdown()


def test_actor_calls_show_per_rank_timing_once_per_cell(kernel):
    kernel.execute("from monarch_kernel import Actor, endpoint\nfrom monarch_kernel.magics import current_mesh\nimport time\n"
                   "class Slow(Actor):\n    @endpoint\n    def work(self, s):\n        import os\n"
                   "        time.sleep(s * (12 if os.environ['RANK'] == '2' else 1))\n"
                   "slow = current_mesh().spawn('slow', Slow)", 30)
    run = kernel.execute("for _ in range(3):\n    slow.work.call(0.05).get()", 30)
    assert run.status == "ok", run.text()
    timing = [o for o in run.outputs() if "per rank" in o.get("data", {}).get("text/plain", "")]
    assert len(timing) == 1  # one view per cell, updated by each call
    text = timing[0]["data"]["text/plain"]
    # rank 2 sleeps 12x as long: a straggler even when a loaded machine wakes the others late
    # (seen once on a 2-core CI box: two ranks' 50 ms sleeps measured 200 ms)
    assert text.startswith("Slow.work (actor mesh 'slow') per rank") and "straggler" in text.splitlines()[3], text
    history = kernel.execute("print(current_mesh().history(last=4))").text()
    assert "'label': 'Slow.work'" in history
