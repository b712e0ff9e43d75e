"""When a distributed cell hangs: the verdict in the running cell, %mesh why / stacks, and a stop
that frees every rank from inside a collective (a real kernel, a 4-rank gloo mesh)."""

import re
import shutil
import time

import pytest
from conftest import wait_until
from kernel_driver import kernel_with

pytestmark = pytest.mark.slow

HANG_S = 3
STRAGGLER = ("%%mesh\nimport time, torch, torch.distributed as dist\nt = torch.ones(4)\n"
             "if dist.get_rank() == 3:\n    time.sleep(60)\ndist.all_reduce(t)")


@pytest.fixture(scope="module")
def kernel():
    yield from kernel_with("%load_ext monarch_kernel\n%mesh up local --gpus 4 --dist gloo\n"
                           f"%mesh config hang {HANG_S}")


@pytest.fixture(autouse=True)
def mesh_left_idle(request):
    """After each test, stop whatever it left running on the mesh (a failed assertion in a test that
    started a --bg cell would otherwise leave every later test of the module facing a busy mesh)."""
    yield
    if "kernel" not in request.fixturenames:
        return
    kernel = request.getfixturevalue("kernel")
    if "busy" in kernel.execute("%mesh status", 30).text():
        kernel.execute("%mesh interrupt", 30)
        wait_until(lambda: "busy" not in kernel.execute("%mesh status", 30).text(), 15)


def verdict_in(run):
    return next((line for line in run.text().splitlines() if " wait in " in line or "different collectives" in line),
                None)


def stop_and_check_every_rank_works(kernel, run):
    """The stop button; every rank out of the cell within 2 s, and the next cell's all_reduce works."""
    stopped_at = time.monotonic()
    kernel.interrupt()
    kernel.collect(run, 30)
    assert "default process group was made anew on every rank" in run.text(), run.text()
    after = kernel.execute("%%mesh\nimport torch, torch.distributed as dist\nt = torch.ones(2)\n"
                           "dist.all_reduce(t)\nprint('sum', t.tolist())", 30)
    assert after.status == "ok" and "[0-3] sum [4.0, 4.0]" in after.text(), after.text()
    assert time.monotonic() - stopped_at < 2.0  # the next cell ran on every rank within 2 s of the stop


def test_a_straggler_is_named_in_the_running_cell_and_the_stop_frees_every_rank(kernel):
    run = kernel.submit(STRAGGLER)
    kernel.collect(run, HANG_S + 5 + 5, until=verdict_in)
    prompt = re.search(r"In\[(\d+)\]", run.text()).group(1)
    line = verdict_in(run)
    assert re.fullmatch(r"ranks 0-2 wait in all_reduce #\d+ \(4 floats, default group\) for \d+ s; rank 3 has not "
                        rf"entered #\d+: it is at In\[{prompt}\] line 4  time.sleep\(60\)", line), line  # (the cell's body)
    assert time.monotonic() - run.started < HANG_S + 5 + 3
    assert "ranks 0-2 (main thread" in run.text() and "rank 3 (main thread" in run.text()  # the stacks, grouped
    stop_and_check_every_rank_works(kernel, run)


def test_a_desync_names_the_collective_of_each_group_of_ranks(kernel):
    run = kernel.submit("%%mesh\nimport torch, torch.distributed as dist\nt = torch.ones(4)\n"
                        "if dist.get_rank() == 3:\n    dist.barrier()\nelse:\n    dist.all_reduce(t)")
    kernel.collect(run, HANG_S + 10, until=verdict_in)
    line = verdict_in(run)
    assert line.startswith("the ranks of the default group called different collectives at #"), line
    assert "ranks 0-2 all_reduce (In[" in line and "line 6  dist.all_reduce(t))" in line, line
    assert "rank 3 barrier (In[" in line and "line 4  dist.barrier())" in line, line
    stop_and_check_every_rank_works(kernel, run)


def test_a_subgroup_hang_names_the_groups_ranks_and_name(kernel):
    setup = kernel.execute("%%mesh\nimport torch.distributed as dist\n"
                           "pair = dist.new_group([1, 2], group_desc='pair')", 30)
    assert setup.status == "ok", setup.text()
    run = kernel.submit("%%mesh\nimport time, torch, torch.distributed as dist\nt = torch.ones(8)\n"
                        "if dist.get_rank() == 1:\n    dist.all_reduce(t, group=pair)\n"
                        "elif dist.get_rank() == 2:\n    time.sleep(60)")
    kernel.collect(run, HANG_S + 10, until=verdict_in)
    line = verdict_in(run)
    assert re.match(r"rank 1 wait in all_reduce #\d+ \(8 floats, group 'pair' of ranks 1-2\) for \d+ s; rank 2 has "
                    r"not entered #\d+: it is at In\[\d+\] line 6  time.sleep\(60\)", line), line
    kernel.interrupt()
    kernel.collect(run, 30)
    assert "process groups made in cells are gone ('pair' (ranks 1,2))" in run.text(), run.text()


def test_a_dead_rank_that_the_others_wait_for(kernel):
    run = kernel.submit("%%mesh\nimport os, torch, torch.distributed as dist\nt = torch.ones(4)\n"
                        "if dist.get_rank() == 2:\n    os._exit(3)\ndist.all_reduce(t)")
    kernel.collect(run, HANG_S + 10, until=verdict_in)
    line = verdict_in(run)
    assert re.fullmatch(r"ranks? [0-3,-]+ wait in all_reduce #\d+ \(4 floats, default group\) for rank 2, which died "
                        r"\(exit code 3\)", line), line
    kernel.interrupt()
    kernel.collect(run, 30)
    assert "exit code 3" in run.text()
    why = kernel.execute("%mesh why", 30)  # on demand, after the stop
    assert why.status == "ok" and "rank 2 died (exit code 3)" in why.text(), why.text()
    assert kernel.execute("%mesh restart", 120).status == "ok"


def test_stacks_of_a_background_cell_that_hangs_are_grouped(kernel):
    run = kernel.execute("%%mesh --bg\nimport time\nx = 0\nwhile True:\n    time.sleep(0.5)", 30)
    assert run.status == "ok"
    texts = []  # a --bg cell's reply comes when it is sent: on a busy machine a rank may start it later

    def all_ranks_in_the_cell():
        texts.append(kernel.execute("%mesh stacks", 30).text())
        return "ranks 0-3 (main thread, running In[" in texts[-1]

    assert wait_until(all_ranks_in_the_cell, 20), texts[-1]
    text = texts[-1]
    assert "line 4  time.sleep(0.5)" in text, text
    assert "no rank is inside a collective" in text
    native = kernel.execute("%mesh stacks --native", 60).text()
    if shutil.which("py-spy") is None:  # (as in CI): it says how to get it
        assert "py-spy is not installed on host" in native and "pip install py-spy" in native, native
    else:
        assert "rank 0 (pid" in native, native
    status = kernel.execute("%mesh interrupt", 30)
    assert status.status == "ok"
    assert wait_until(lambda: "busy" not in kernel.execute("%mesh status", 30).text(), 10)


def test_a_background_cell_stopped_inside_a_collective_leaves_a_working_process_group(kernel):
    """A --bg cell whose ranks 0-2 wait in all_reduce for rank 3, stopped with %mesh interrupt (nobody
    waits on it, so the stop is not the future's own): the group is made anew, and the next
    collective works on every rank (before, every later collective failed until %mesh restart)."""
    run = kernel.execute("%%mesh --bg\n" + STRAGGLER.removeprefix("%%mesh\n"), 30)
    assert run.status == "ok", run.text()
    assert wait_until(lambda: "in all_reduce" in kernel.execute("%mesh status", 30).text(), 15)
    assert kernel.execute("%mesh interrupt", 30).status == "ok"
    assert wait_until(lambda: "busy" not in kernel.execute("%mesh status", 30).text(), 15)
    after = kernel.execute("%%mesh\nimport torch, torch.distributed as dist\nt = torch.ones(2)\n"
                           "dist.all_reduce(t)\nprint('sum', t.tolist())", 30)
    assert after.status == "ok" and "[0-3] sum [4.0, 4.0]" in after.text(), after.text()


def test_status_shows_the_collective_each_rank_waits_in(kernel):
    """%mesh status (and the widget and sidebar, which draw the same rows) while ranks wait in a collective."""
    from monarch_kernel import MeshInterrupted, local_mesh
    from monarch_kernel.api.sinks import PlainSink
    from monarch_kernel.views.meshview import mesh_snapshot

    with local_mesh(gpus=4, dist="gloo", name="status-rows") as mesh:
        mesh.hang_after_s = None
        sink = PlainSink(__import__("io").StringIO())
        future = mesh.run_async(STRAGGLER.removeprefix("%%mesh\n"), sink=sink, name="In[1]")
        rows = []

        def waiting_rows():
            rows[:] = [cell.detail for cell in mesh_snapshot(mesh).cells()]
            return sum("in all_reduce #1 (default group) for" in row for row in rows) == 3

        assert wait_until(waiting_rows, 15), rows
        assert rows[3].startswith("In[1] for") and "all_reduce" not in rows[3]
        mesh.interrupt()
        with pytest.raises(MeshInterrupted):
            future.get(timeout=10)


def test_a_profiled_cell_writes_one_trace_with_a_process_per_rank(kernel, tmp_path):
    run = kernel.execute(f"%%mesh --profile {tmp_path}\nimport torch, torch.distributed as dist\n"
                         "x = torch.randn(64, 64)\nfor _ in range(5):\n    y = x @ x\n"
                         "dist.all_reduce(y)\nprint('done')", 60)
    assert run.status == "ok", run.text()
    text = run.text()
    assert "[0-3] done" in text and "USDT" not in text  # the profiler's own chatter stays out of the cell
    path = re.search(r"written to (\S+\.trace\.json\.gz)", text).group(1)
    import gzip
    import json

    trace = json.load(gzip.open(path, "rt"))
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    ops = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "aten::mm" in ops
    assert {e["pid"] for e in trace["traceEvents"] if e.get("name") == "aten::mm"} == {0, 1, 2, 3}
    table = text[text.index("operation"):]
    assert re.search(r"aten::mm\s+20\s+[\d.]+\s+[0-3]\s+[\d.]+", table), table  # 5 calls x 4 ranks, the slowest rank


def test_sampling_a_running_mesh_shows_where_each_group_of_ranks_spends_its_time(kernel):
    run = kernel.execute("%%mesh --bg\nimport time, torch.distributed as dist\n"
                         "def slow():\n    time.sleep(0.3)\ndef fast():\n    time.sleep(0.1)\n"
                         "while True:\n    slow() if dist.get_rank() < 2 else fast()", 30)
    assert run.status == "ok"
    table = kernel.execute("%mesh profile --seconds 2", 30).text()
    assert re.search(r"\d+ samples of each rank over 2.0 s", table), table
    slow = re.search(r"ranks 0-1\n +[\d.]+%  In\[\d+\] line 7  slow\(\) .*\n +[\d.]+%    In\[\d+\] line 3  "
                     r"time.sleep\(0.3\)", table)
    fast = re.search(r"ranks 2-3\n +[\d.]+%  In\[\d+\] line 7  slow\(\) .*\n +[\d.]+%    In\[\d+\] line 5  "
                     r"time.sleep\(0.1\)", table)
    assert slow and fast, table  # a block per group of ranks, each frame under its caller
    kernel.execute("%mesh interrupt", 30)
    assert wait_until(lambda: "busy" not in kernel.execute("%mesh status", 30).text(), 10)


def test_a_long_cell_that_keeps_making_progress_shows_no_verdict():
    """Past the hang limit a running cell is looked at every few seconds, cheaply (the groups'
    counters); ranks whose collectives keep finishing are not stuck."""
    import io

    from monarch_kernel import local_mesh
    from monarch_kernel.api.sinks import PlainSink

    with local_mesh(gpus=4, dist="gloo", name="progressing") as mesh:
        mesh.hang_after_s = 1
        out = io.StringIO()
        # the same number of collectives on every rank (a deadline per rank would leave the last
        # all_reduce of a rank that started early without partners)
        mesh.run("import time, torch, torch.distributed as dist\nt = torch.ones(4)\n"
                 "for _ in range(500):\n    dist.all_reduce(t)\n    time.sleep(0.015)", sink=PlainSink(out))
        assert "no progress" not in out.getvalue() and " wait in " not in out.getvalue(), out.getvalue()


def test_stopping_an_actor_call_stuck_in_a_collective_frees_every_rank_and_the_group_works_again(capfd):
    """Ranks 0-2 of an actor call wait in all_reduce for rank 3, which sleeps: the call's timeout stops it
    on every rank (the collective ended where a signal cannot reach), the default group is made anew, and
    the next call's all_reduce works on every rank."""
    from monarch_kernel import MeshTimeoutError, local_mesh

    source = (
        "import time, torch, torch.distributed as dist\n"
        "from monarch_kernel import Actor, current_rank, endpoint\n"
        "class Reducer(Actor):\n"
        "    @endpoint\n"
        "    def reduce(self, skip):\n"
        "        if current_rank().rank == skip:\n"
        "            time.sleep(60)\n"
        "        t = torch.ones(1)\n"
        "        dist.all_reduce(t)\n"
        "        return t.item()\n")
    scope: dict = {}
    exec(compile(source, "<reducer>", "exec"), scope)  # a class of no importable module: it travels by value
    with local_mesh(gpus=4, dist="gloo", name="stuck-actor") as mesh:
        reducers = mesh.spawn("reducers", scope["Reducer"])
        assert list(reducers.reduce.call(-1).get(timeout=30).values()) == [4.0] * 4
        with pytest.raises(MeshTimeoutError):
            reducers.reduce.call(3).get(timeout=2)
        stopped = time.monotonic()
        assert list(reducers.reduce.call(-1).get(timeout=30).values()) == [4.0] * 4
        assert time.monotonic() - stopped < 5
        err = capfd.readouterr().err
        assert "ended collectives in progress on ranks 0-2" in err and "made anew on every rank" in err, err


def test_an_actor_call_that_hangs_shows_the_straggler_verdict_while_it_waits(capfd, tmp_path):
    """An actor call past the mesh's hang limit is looked at while the notebook waits on it: ranks 0-2 wait
    in all_reduce for rank 3, which sleeps in the endpoint; the verdict names both, with the endpoint's
    line, and the call then ends normally when rank 3 comes."""
    import importlib.util
    import sys

    import cloudpickle

    path = tmp_path / "late_actor.py"  # the user's own file (ranks on this machine read its lines)
    path.write_text(
        "import time, torch, torch.distributed as dist\n"
        "from monarch_kernel import Actor, current_rank, endpoint\n"
        "class Late(Actor):\n"
        "    @endpoint\n"
        "    def reduce(self, late, seconds):\n"
        "        if current_rank().rank == late:\n"
        "            time.sleep(seconds)\n"
        "        t = torch.ones(4)\n"
        "        dist.all_reduce(t)\n"
        "        return t[0].item()\n")
    spec = importlib.util.spec_from_file_location("late_actor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["late_actor"] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # (ranks cannot import it: it travels by value)
    try:
        _late_actor_verdict(module, capfd)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules["late_actor"]


def _late_actor_verdict(module, capfd) -> None:
    from monarch_kernel import local_mesh

    with local_mesh(gpus=4, dist="gloo", name="late-actor") as mesh:
        mesh.hang_after_s = 1
        late = mesh.spawn("late", module.Late)
        assert list(late.reduce.call(3, 8).get(timeout=60).values()) == [4.0] * 4
        out = capfd.readouterr()
        text = out.out + out.err
        assert "no progress on the ranks of the call Late.reduce" in text, text
        assert re.search(r"ranks 0-2 wait in all_reduce #\d+ \(4 floats, default group\)", text), text
        assert re.search(r"rank 3 has not entered #\d+: it is at .*late_actor\.py:7 in reduce +time\.sleep\(seconds\)",
                         text), text

