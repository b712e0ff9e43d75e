from monarch_kernel.errors import MeshInterrupted, RankFailure, RemoteError
from monarch_kernel.errortext import format_failures, group_failures

TB = 'Traceback (most recent call last):\n  File "<mesh In[2]>", line 1, in <module>\n    1/0\nZeroDivisionError: division by zero\n'


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
