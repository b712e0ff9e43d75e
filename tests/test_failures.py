import pytest

from monarch_kernel.core.errors import MeshInterrupted, RankFailure, RemoteError
from monarch_kernel.core.failures import FailureKind, format_failures, group_failures, set_traceback_rewriter
from monarch_kernel.views.errortext import ipython_cell_names

TB = ('Traceback (most recent call last):\n  File "<mesh In[2]>", line 1, in <module>\n    1/0\n'
      "ZeroDivisionError: division by zero\n")


def test_identical_tracebacks_are_grouped_with_their_ranks():
    failures = [RankFailure(r, "h", "exception", "ZeroDivisionError", "division by zero", TB) for r in (0, 1, 3)]
    failures.append(RankFailure(2, "h", "exception", "KeyError", "KeyError: 'x'", "Traceback...\nKeyError: 'x'\n"))
    groups = group_failures(failures)
    assert [ranks for ranks, _ in groups] == [[0, 1, 3], [2]]
    text = format_failures(failures, color=False)
    assert "[ranks 0-1,3 (host h)] remote traceback:" in text and text.count("division by zero") == 1
    assert "[rank 2 (host h)] remote traceback:" in text


def test_dead_ranks_show_status_and_stderr_tail():
    dead = RankFailure(1, "gpu-a", "died", "RankDied", "rank 1 died: exit code 3", pid=77, exit_code=3,
                       stderr_tail=("Fatal error", "abort"))
    text = format_failures([dead], color=False)
    assert "rank 1 died: exit code 3" in text and "last stderr lines" in text and "abort" in text


def test_ipython_renders_remote_errors_without_local_frames():
    err = RemoteError("In[2] failed on 1 of 4 ranks", [RankFailure(0, "h", "exception", "ZeroDivisionError",
                                                                    "division by zero", TB)])
    lines = err._render_traceback_()
    assert "In[2] failed" in lines[0] and any("1/0" in line for line in lines)
    assert isinstance(MeshInterrupted("x", []), KeyboardInterrupt)
    assert not isinstance(MeshInterrupted("x", []), Exception)


def test_remote_tracebacks_name_notebook_cells_as_ipython_does():
    class Compiler:
        def format_code_name(self, name):
            return ("Cell", "In[2]") if name == "<mesh In[2]>" else None

    class Shell:
        compile = Compiler()

    failure = RankFailure(0, "h", "exception", "ZeroDivisionError", "division by zero", TB)
    set_traceback_rewriter(ipython_cell_names(Shell()))
    try:
        assert "Cell In[2], line 1" in format_failures([failure], color=False)
    finally:
        set_traceback_rewriter(None)
    assert 'File "<mesh In[2]>", line 1' in format_failures([failure], color=False)


def test_failure_kinds_are_an_enum_that_reads_as_text():
    failure = RankFailure(0, "h", "died", "RankDied", "gone")
    assert failure.kind is FailureKind.DIED and f"{failure.kind}" == "died"
    with pytest.raises(ValueError):
        RankFailure(0, "h", "exploded", "X", "?")
