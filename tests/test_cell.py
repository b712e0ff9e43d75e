import pytest

from monarch_kernel.core.source import check_syntax
from monarch_kernel.rank.cell import CellRunner, describe_failure

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def run(code, ns=None):
    runner = CellRunner(ns if ns is not None else {})
    return runner, runner.run(code, "<mesh In[1]>")


def test_last_expression_is_the_value_and_state_persists():
    runner, value = run("x = 40\nx + 2")
    assert value == 42
    assert runner.run("x * 2", "<mesh In[2]>") == 80
    assert runner.run("y = 1", "<mesh In[3]>") is None


def test_trailing_semicolon_suppresses_the_value():
    _, value = run("x = 3\nx * 2;")
    assert value is None


def test_top_level_await():
    _, value = run("import asyncio\nawait asyncio.sleep(0)\n'done'")
    assert value == "done"


def test_traceback_shows_the_cells_own_lines_without_our_frames():
    runner = CellRunner({})
    with pytest.raises(ZeroDivisionError) as info:
        runner.run("a = 1\nb = 0\na / b\n", "<mesh In[7]>")
    failure = describe_failure(info.value)
    assert 'File "<mesh In[7]>", line 3' in failure.traceback
    assert "a / b" in failure.traceback
    assert "monarch_kernel" not in failure.traceback
    assert failure.error_type == "ZeroDivisionError"


def test_sys_exit_is_reported_not_fatal():
    runner = CellRunner({})
    with pytest.raises(SystemExit) as info:
        runner.run("import sys\nsys.exit(4)", "<c>")
    failure = describe_failure(info.value)
    assert failure.error_type == "SystemExit" and "sys.exit(4)" in failure.message


def test_syntax_error_is_caught_before_sending():
    with pytest.raises(SyntaxError) as info:
        check_syntax("x = (\n", "<mesh In[2]>")
    assert info.value.filename == "<mesh In[2]>"
