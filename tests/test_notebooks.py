"""The example notebooks, executed end to end with a real kernel (nbclient)."""

import ast
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(name):
    path = os.path.join(HERE, "notebooks", name)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    return nb


def texts(cell):
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type == "error":
            out.append("\n".join(o.traceback))
        else:
            out.append(o.data.get("text/plain", ""))
    return "\n".join(out)


def cell_with(nb, snippet):
    return next(c for c in nb.cells if c.cell_type == "code" and snippet in c.source)


def test_quickstart_runs_and_shows_real_output():
    nb = execute("01_quickstart.ipynb")
    assert "[0-3] sum [6.0, 6.0]" in texts(cell_with(nb, "dist.all_reduce(t)"))
    shell = texts(cell_with(nb, "!echo"))
    assert "[0-3] torch 2." in shell and "rank 3 of 4 on" in shell
    odd = texts(cell_with(nb, "odd rank"))
    assert "ValueError: odd rank 1" in odd and "ValueError: odd rank 3" in odd and "<mesh In[" in odd
    assert "0       1       4       9" in texts(cell_with(nb, "await fut"))
    assert "is down" in texts(nb.cells[-1])


def test_ddp_notebook_trains_and_checks_parameters():
    nb = execute("02_ddp_training.ipynb")
    assert "identical on all 4 ranks" in texts(cell_with(nb, "params = current_mesh().pull"))
    plot = cell_with(nb, "plt.plot(losses)")
    pngs = [o for o in plot.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pngs) == 1 and "rank 0" in pngs[0].data["text/plain"]


def test_actors_notebook_trains_with_a_parameter_server():
    nb = execute("04_actors.ipynb")
    spawned = texts(cell_with(nb, "spawn(\"workers\""))
    assert "ParameterServer on {hosts: 1} (ranks 0)" in spawned and "Worker on {hosts: 1, gpus: 3} (ranks 1-3)" in spawned
    streamed = texts(cell_with(nb, "workers.step.stream"))
    assert sorted(line.split()[3] for line in streamed.splitlines() if line.startswith("worker on rank")) == ["1", "2", "3"]
    learned = next(line for line in streamed.splitlines() if line.startswith("learned:"))
    target = next(line for line in streamed.splitlines() if line.startswith("target:"))
    learned, target = (ast.literal_eval(line.split(":", 1)[1].strip()) for line in (learned, target))
    assert max(abs(a - b) for a, b in zip(learned, target)) < 0.05
    failure = texts(cell_with(nb, "workers.check.call(-1)"))
    assert "Actor call workers.check failed on ranks 1-3 (Worker.check): ValueError" in failure
    assert 'raise ValueError(f"batch index must be >= 0, got {batch}")' in failure
    assert "Cell In[2], line 41, in check" in failure  # named like IPython names local cells
    assert "[0] updates:" in texts(cell_with(nb, 'actors["server"]'))
    monarch = texts(cell_with(nb, "from monarch_kernel.monarch.actor import"))  # the "coming from Monarch" part
    assert "samples: [(0, 0), (0, 10), (0, 20), (1, 0), (1, 10), (1, 20)]" in monarch
    assert "sum of scales: 20" in monarch
    status = texts(cell_with(nb, "%mesh status samplers"))  # a mesh started by spawn_procs is a mesh like any
    assert "samplers" in status and "rank" in status


@pytest.mark.timeout(480)  # (three plans, two trained layouts, a trial)
def test_planning_notebook_plans_trials_applies_and_trains_like_one_process():
    nb = execute("09_planning.ipynb")
    planned = texts(cell_with(nb, "plan = mesh.plan("))
    assert "ddp=4" in planned and "over 10 MiB" in planned and "best: " in planned
    shown = [o.data for o in cell_with(nb, "plan = mesh.plan(").outputs if o.output_type == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in data and "best: " in data["text/plain"]
               for data in shown)  # the plan's widget
    ratios = [float(line.rsplit(" ", 1)[1]) for line in texts(cell_with(nb, "plan.trial(")).splitlines()
              if "estimated/measured peak" in line]
    assert ratios and all(0.9 <= r <= 1.1 for r in ratios)
    shown = texts(cell_with(nb, "losses = [round(train_step"))  # a ValueMesh: every rank's list, the same
    ours = ast.literal_eval(shown.split("all ranks: ", 1)[1].split("]", 1)[0] + "]")
    reference = ast.literal_eval(texts(cell_with(nb, "reference_losses(")).strip())
    assert len(ours) == len(reference) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, reference))
    best = texts(cell_with(nb, "plan.trial(")).split("best: ", 1)[1].split()[0]
    assert f"layout {best} on 4 ranks" in texts(cell_with(nb, "plan.code(")) and "torchrun" in texts(cell_with(nb, "plan.code("))
    assert "module model:" in texts(cell_with(nb, "%mesh sharding model"))
    assert "H100" in texts(cell_with(nb, "world={'hosts': 4"))
    llama = texts(cell_with(nb, "llama_plan = mesh.plan("))  # a Hugging Face model, mixed precision, checkpointing
    assert "fsdp=4,ac=1,mp=bf16" in llama and "key/value cache" not in llama.split("best:")[0] and "n/a" not in llama
    trained = texts(cell_with(nb, "train_step(llama_batch())"))
    assert "torch.float32" in trained and "all ranks" in trained  # fp32 master weights, the same losses everywhere
    assert "is down" in texts(nb.cells[-1])


def test_debugging_notebook_shows_both_verdicts_and_frees_the_ranks():
    nb = execute("08_debugging.ipynb")
    straggler = texts(cell_with(nb, "time.sleep(60)"))
    assert re.search(r"ranks 0-2 wait in all_reduce #\d+ \(4 floats, default group\) for \d+ s; rank 3 has not entered "
                     r"#\d+: it is at In\[\d+\] line 4  time.sleep\(60\)", straggler), straggler
    assert "made anew on every rank" in straggler
    desync = texts(cell_with(nb, "dist.barrier()"))
    assert "called different collectives at #" in desync and "rank 3 barrier" in desync, desync
    assert "[0-3] sum [4.0, 4.0]" in texts(cell_with(nb, "print('sum'"))
    assert "ranks 0-3 (main thread, running In[" in texts(cell_with(nb, "%mesh stacks"))
    assert re.search(r"\d+ samples of each rank", texts(cell_with(nb, "%mesh profile --seconds")))
    assert "trace.json.gz" in texts(cell_with(nb, "%%mesh --profile"))
    assert "stops in rank 2 of mesh 'debug'" in texts(cell_with(nb, "%mesh debug rank 2"))
    assert "rank 2 total 120.0" in texts(cell_with(nb, "<- click this line's gutter"))  # no debugger on: it runs
    assert "is down" in texts(nb.cells[-1])


def test_keep_the_model_notebook_survives_a_real_kernel_restart(tmp_path, monkeypatch):
    """Run up to the restart note, restart the kernel for real, then run the rest: the model comes back."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    path = os.path.join(HERE, "notebooks", "10_keep_the_model.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "markdown" and "Now restart the kernel" in cell.source:
                run_sync(client.km.restart_kernel)(now=False)  # (nbclient's managers are async)
                run_sync(client.kc.wait_for_ready)(timeout=60)
            elif cell.cell_type == "code":
                client.execute_cell(cell, index)
    attached = texts(cell_with(nb, "%mesh attach kept"))
    assert "attached to mesh 'kept'" in attached and re.search(r"\[0-1\] step \d+ loss", attached), attached
    assert "still runs on ranks 0-1" in attached or "ranks 0-1: 10" in attached, attached
    listing = next(c for c in nb.cells if c.cell_type == "code" and c.source.endswith("%mesh attach"))
    assert "kept: local {hosts: 1, gpus: 2}" in texts(listing), texts(listing)
    assert "[0-1] steps done: 10" in texts(cell_with(nb, "steps done")), texts(cell_with(nb, "steps done"))
    assert "2.0" in texts(cell_with(nb, "dist.all_reduce(t)"))
