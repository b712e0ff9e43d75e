"""The verdict across ranks, from the reports ranks give of themselves (no process needed)."""

import pytest

from monarch_kernel.core.hangs import Frame, GroupProgress, RankReport, diagnose, grouped_stacks

pytestmark = pytest.mark.unit

CELL = "<mesh In[7]>"


def cell_frame(lineno, line):
    return Frame(CELL, lineno, "<module>", line, True)


LIB = Frame("/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py", 83, "wrapper", "", False)


def report(rank, stack, *groups, running="In[7]"):
    return RankReport(rank, running, tuple(stack), tuple(groups))


def default(entered, completed, op="all_reduce", what="4 floats", for_s=31.0, ranks=(0, 1, 2, 3)):
    return GroupProgress("0", "default_pg", ranks, entered, completed, op if entered > completed else "",
                         what if entered > completed else "", for_s if entered > completed else 0.0)


def test_a_straggler_is_named_with_the_line_it_is_at():
    reports = {r: report(r, [cell_frame(4, "dist.all_reduce(t)"), LIB], default(58, 57)) for r in range(3)}
    reports[3] = report(3, [cell_frame(5, "time.sleep(60)")], default(57, 57))
    verdict = diagnose(reports, (0, 1, 2, 3))
    assert verdict.hung
    assert str(verdict) == ("ranks 0-2 wait in all_reduce #58 (4 floats, default group) for 31 s; "
                            "rank 3 has not entered #58: it is at In[7] line 5  time.sleep(60)")


def test_a_desync_names_each_collective_with_its_code_line():
    reports = {r: report(r, [cell_frame(4, "dist.all_reduce(t)")], default(58, 57)) for r in range(3)}
    reports[3] = report(3, [cell_frame(6, "dist.barrier()")], default(58, 57, op="barrier", what=""))
    line = str(diagnose(reports, (0, 1, 2, 3)))
    assert line.startswith("the ranks of the default group called different collectives at #58: ")
    assert "ranks 0-2 all_reduce (In[7] line 4  dist.all_reduce(t))" in line
    assert "rank 3 barrier (In[7] line 6  dist.barrier())" in line


def test_a_dead_rank_that_the_others_wait_for():
    reports = {r: report(r, [cell_frame(4, "dist.all_reduce(t)")], default(12, 11)) for r in (0, 1, 3)}
    line = str(diagnose(reports, (0, 1, 2, 3), dead={2: "exit code 3"}))
    assert line == "ranks 0-1,3 wait in all_reduce #12 (4 floats, default group) for rank 2, which died (exit code 3)"


def test_a_subgroup_is_named_by_its_ranks_and_description():
    pair = GroupProgress("2", "pair", (1, 2), 3, 2, "all_reduce", "8 floats", 40.0)
    pair_behind = GroupProgress("2", "pair", (1, 2), 2, 2)
    reports = {0: report(0, [cell_frame(2, "x = 1")], default(5, 5)),
               1: report(1, [cell_frame(3, "dist.all_reduce(t, group=pair)")], default(5, 5), pair),
               2: report(2, [cell_frame(9, "time.sleep(100)")], default(5, 5), pair_behind),
               3: report(3, [cell_frame(2, "x = 1")], default(5, 5))}
    line = str(diagnose(reports, (0, 1, 2, 3)))
    assert line == ("rank 1 wait in all_reduce #3 (8 floats, group 'pair' of ranks 1-2) for 40 s; "
                    "rank 2 has not entered #3: it is at In[7] line 9  time.sleep(100)")


def test_ranks_without_any_collective_are_shown_where_they_are():
    reports = {r: report(r, [cell_frame(5, "time.sleep(60)")], default(3, 3)) for r in range(2)}
    reports[2] = report(2, [cell_frame(8, "load(batch)")], default(3, 3))
    verdict = diagnose(reports, (0, 1, 2))
    assert not verdict.hung
    assert str(verdict) == ("no rank is inside a collective: ranks 0-1 at In[7] line 5  time.sleep(60); "
                            "rank 2 at In[7] line 8  load(batch)")


def test_every_rank_inside_and_none_finishing_is_the_collective_itself():
    reports = {r: report(r, [cell_frame(4, "dist.all_reduce(t)")], default(9, 8, ranks=(0, 1))) for r in range(2)}
    assert "the collective itself is stuck" in str(diagnose(reports, (0, 1)))


def test_silent_ranks_are_said_plainly():
    reports = {0: report(0, [cell_frame(4, "dist.all_reduce(t)")], default(9, 8, ranks=(0, 1)))}
    text = str(diagnose(reports, (0, 1), silent=(1,)))
    assert "rank 1 did not say where it is" in text and "rank 1 did not answer" in text


def test_identical_stacks_are_shown_once_with_their_ranks():
    same = [cell_frame(4, "dist.all_reduce(t)"), LIB]
    reports = {r: report(r, same) for r in range(3)}
    reports[3] = report(3, [cell_frame(5, "time.sleep(60)")])
    groups = grouped_stacks(reports)
    assert [(ranks, thread) for ranks, thread, _ in groups] == [((0, 1, 2), "main"), ((3,), "main")]


def test_a_rank_that_never_used_the_group_has_not_entered_it():
    reports = {r: report(r, [cell_frame(5, "dist.all_reduce(t)")], default(1, 0)) for r in range(3)}
    reports[3] = report(3, [cell_frame(4, "time.sleep(60)")])  # its flight recorder lists no group yet
    assert str(diagnose(reports, (0, 1, 2, 3))).endswith("rank 3 has not entered #1: it is at In[7] line 4  time.sleep(60)")


def test_ranks_traces_are_lined_up_by_their_clock_offsets(tmp_path):
    import gzip
    import json

    from monarch_kernel.api.profiles import clock_offsets, write_trace
    from monarch_kernel.wire.ops import ProfileTrace

    readings = iter([{0: 1e9, 1: 1e9 + 1e6}] * 5)  # rank 1's clock runs 1 s ahead
    offsets = clock_offsets(lambda op: next(readings))
    assert abs((offsets[1] - offsets[0]) - 1e6) < 1
    same_moment = {0: ProfileTrace([{"ph": "X", "name": "aten::mm", "ts": 10.0, "dur": 1}], 5e6, [("aten::mm", 2, 30.0)]),
                   1: ProfileTrace([{"ph": "X", "name": "aten::mm", "ts": 10.0, "dur": 1}], 5e6 + 1e6,
                                   [("aten::mm", 2, 50.0)])}
    report = write_trace(same_moment, offsets, str(tmp_path), "In[3]")
    events = [e for e in json.load(gzip.open(report.path, "rt"))["traceEvents"] if e.get("ph") == "X"]
    assert abs(events[0]["ts"] - events[1]["ts"]) < 1 and {e["pid"] for e in events} == {0, 1}
    assert report.top == [("aten::mm", 4, 80.0, 1, 50.0)]  # rank 1 was the slowest
