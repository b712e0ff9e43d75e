"""%mesh / %%mesh in a real IPython shell (terminal flavour: no kernel)."""

import re

import pytest
from conftest import ipython_shell as get_ipython
from IPython.utils.capture import capture_output

from monarch_kernel.core.values import ValueMesh
from monarch_kernel.magics import current_registry


@pytest.fixture(scope="module")
def ip():
    shell = get_ipython()
    shell.run_line_magic("load_ext", "monarch_kernel")
    yield shell
    shell.run_line_magic("unload_ext", "monarch_kernel")


@pytest.fixture
def main_mesh(ip):
    """Mesh 'main' (4 ranks, the default), started here if an earlier test did not leave it up."""
    registry = current_registry()
    if "main" not in registry.names():
        result, text = run(ip, "%mesh up local --gpus 4 --dist gloo --name main --env MY_FLAG=on")
        assert result.success, text
    run(ip, "%mesh use main")
    return "main"


def run(ip, code):
    with capture_output() as cap:
        result = ip.run_cell(code)
    shown = "\n".join(out.data.get("text/plain", "") for out in cap.outputs)
    return result, cap.stdout + cap.stderr + shown


@pytest.mark.parametrize("line", ["%mesh", "%mesh bogus", "%mesh up local --gpus x", "%mesh up ssh",
                                  "%mesh status", "%mesh pull 1", "%mesh use nope", "%%mesh\n1"])
def test_bad_input_gives_a_short_message_not_a_traceback(ip, line):
    result, text = run(ip, line)
    assert not result.success
    assert "UsageError" in text and "Traceback" not in text and "monarch_kernel/" not in text


@pytest.mark.parametrize("line", ["%mesh --help", "%mesh help", "%mesh up --help", "%%mesh -h\nraise SystemExit"])
def test_help_is_help_not_an_error(ip, line):
    result, text = run(ip, line)
    assert result.success and "UsageError" not in text
    assert "%mesh up local" in text and "%%mesh [--name NAME]" in text and "!cmd" in text


def test_a_session_of_magics(ip):
    if "main" in current_registry().names():
        run(ip, "%mesh down main")  # this test starts it itself
    result, text = run(ip, "%mesh up local --gpus 4 --dist gloo --name main --env MY_FLAG=on")
    assert result.success, text
    assert "mesh 'main' {hosts: 1, gpus: 4} dist=gloo (default)" in text and text.count("idle") == 4

    result, text = run(ip, "%%mesh\nimport os, torch, torch.distributed as dist\nt = torch.ones(2) * dist.get_rank()\n"
                           "dist.all_reduce(t)\nprint('sum', t.tolist())\nprint(os.environ['MY_FLAG'])\ndist.get_rank()")
    assert result.success, text
    assert text.count("sum [6.0, 6.0]") == 1 and "[0-3] sum [6.0, 6.0]" in text
    assert isinstance(result.result, ValueMesh) and list(result.result.values()) == [0, 1, 2, 3]

    result, text = run(ip, "%%mesh --gpus 1:3\ndist.get_rank()")
    assert result.result.by_rank() == {1: 1, 2: 2}
    result, text = run(ip, "%%mesh --ranks 0,3 --no-dedupe\nprint('hi')")
    assert "[0] hi" in text and "[3] hi" in text and result.result is None
    result, text = run(ip, "%%mesh --gpus 7\n1")
    assert not result.success and "out of range" in text and "Traceback" not in text

    ip.user_ns["lr"] = 0.5
    result, text = run(ip, "%mesh push lr")
    assert result.success, text
    result, _ = run(ip, "%mesh pull lr * 2")
    assert list(result.result.values()) == [1.0] * 4
    result, text = run(ip, "%mesh push not_defined_here")
    assert "not defined in the notebook: not_defined_here" in text

    result, text = run(ip, "%%mesh\nfrom torch.distributed.device_mesh import init_device_mesh\n"
                           "from torch.distributed.tensor import distribute_tensor, Shard\n"
                           "w = distribute_tensor(torch.ones(8, 2), init_device_mesh('cpu', (4,)), [Shard(0)])")
    assert result.success, text
    result, text = run(ip, "%mesh sharding w")
    assert "placements (Shard(0))" in text  # drawn with rich in a terminal
    assert re.search(r"dim 0 \[6:8\]\s*│\s*localhost:3 \(rank 3\)", text), text
    result, text = run(ip, "%mesh sharding w --rows 5")
    assert not result.success and "out of range" in text and "Traceback" not in text

    result, text = run(ip, "%%mesh\nimport time\ntime.sleep(0.4 if dist.get_rank() == 3 else 0.01)")
    assert result.success, text
    lines = [line for line in text.splitlines() if line.strip().startswith("localhost:")]
    assert len(lines) == 4 and "straggler" in lines[3] and not any("straggler" in x for x in lines[:3])
    history = current_registry().get().history(last=4)
    records = history.to_dict("records") if hasattr(history, "to_dict") else history
    assert [r["rank"] for r in records] == [0, 1, 2, 3] and records[3]["seconds"] >= 0.4
    result, text = run(ip, "%mesh config timing off")
    assert "timing after each %%mesh cell: off" in text
    result, text = run(ip, "%%mesh\n1")
    assert "localhost:0 (rank 0)" not in text
    run(ip, "%mesh config timing on")

    result, text = run(ip, "%%mesh\nraise KeyError('k')")
    assert not result.success and "KeyError: 'k'" in text and "ranks 0-3" in text
    assert "magics/" not in text and "futures.py" not in text

    result, text = run(ip, "%%mesh\nx = (")
    assert not result.success and "SyntaxError" in text and "mesh_magic" not in text, text


def test_on_off_routes_every_cell(ip, main_mesh):
    run(ip, "%mesh on")
    result, text = run(ip, "import torch.distributed as dist\ndist.get_rank() * 10")
    assert isinstance(result.result, ValueMesh) and list(result.result.values()) == [0, 10, 20, 30]
    run(ip, "%mesh off")
    result, _ = run(ip, "40 + 2")
    assert result.result == 42


def test_ipython_syntax_runs_on_every_rank(ip, main_mesh, tmp_path):
    result, text = run(ip, "%%mesh\nx = 21\n!echo rank $RANK got {x * 2}\nlines = !printf 'a\\nb\\n'\nlines")
    assert result.success, text
    assert all(f"[{r}] rank {r} got 42" in text for r in range(4))
    assert list(result.result.values()) == [["a", "b"]] * 4
    result, text = run(ip, "%%mesh\n!exit 3\n_exit_code")
    assert list(result.result.values()) == [3] * 4
    run(ip, "%%mesh\nimport os")  # {expr} below reads the rank's own os.environ
    result, text = run(ip, f"%%mesh\n%%writefile {tmp_path}/rank_{{os.environ['RANK']}}.txt\nhello\n")
    assert result.success, text
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank_{r}.txt" for r in range(4)]
    assert (tmp_path / "rank_2.txt").read_text() == "hello\n"
    result, text = run(ip, "%%mesh\n%%bash\necho from bash $((RANK * 10))")
    assert "[0] from bash 0" in text and "[3] from bash 30" in text
    result, text = run(ip, "%%mesh\n%%time\nsum(range(10))")
    assert text.count("wall time") == 4 and list(result.result.values()) == [45] * 4
    result, text = run(ip, "%%mesh\n%timeit pass")
    assert not result.success and "%timeit is not available in mesh cells" in text and "%pip" in text
    run(ip, "%mesh on")
    result, text = run(ip, "!echo routed $RANK")
    run(ip, "%mesh off")
    assert "[2] routed 2" in text


def test_two_meshes_use_and_down(ip, main_mesh):
    result, text = run(ip, "%mesh up local --gpus 1 --dist none --name small")
    assert result.success, text
    result, _ = run(ip, "%%mesh\nimport os\nos.environ['WORLD_SIZE']")
    assert list(result.result.values()) == ["1"]
    run(ip, "%mesh use main")
    result, _ = run(ip, "%%mesh\nimport os\nos.environ['WORLD_SIZE']")
    assert list(result.result.values()) == ["4"] * 4
    result, _ = run(ip, "%%mesh --name small\nos.getpid() > 0")
    assert list(result.result.values()) == [True]
    result, text = run(ip, "%mesh up local --gpus 1 --name small")
    assert "already up" in text
    result, text = run(ip, "%mesh down small")
    assert "mesh 'small' is down" in text
    result, text = run(ip, "%mesh logs --rank 0 --lines 5")
    assert result.success and "--- rank 0" in text
    result, text = run(ip, "%mesh restart")
    assert result.success and text.count("idle") == 4
    result, text = run(ip, "%mesh down")
    assert "mesh 'main' is down" in text
    result, text = run(ip, "%%mesh\n1")
    assert "no mesh is up" in text
