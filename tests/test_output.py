import pytest

from monarch_kernel.views.output import MAX_SHOWN_LINES, OutputGroups, render_html, render_text

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def lines(model):
    return [(g.stream, g.text, g.ranks) for g in model.groups]


def test_identical_lines_collapse_with_their_rank_set():
    model = OutputGroups([0, 1, 2, 3])
    for rank in (2, 0, 3, 1):
        model.add(rank, "stdout", "sum [6.0, 6.0]\n")
    assert lines(model) == [("stdout", "sum [6.0, 6.0]", [2, 0, 3, 1])]
    assert render_text(model) == "[0-3] sum [6.0, 6.0]"


def test_different_lines_keep_their_rank_and_order():
    model = OutputGroups([0, 1])
    model.add(0, "stdout", "a\nrank 0\nb\n")
    model.add(1, "stdout", "a\nrank 1\nb\n")
    # live: "rank 1" came after rank 0's "b", so rank 1's "b" cannot join it yet
    assert [g.text for g in model.groups] == ["a", "rank 0", "b", "rank 1", "b"]
    model.finish()  # aligned: rank-specific lines side by side, shared lines once
    assert lines(model) == [("stdout", "a", [0, 1]), ("stdout", "rank 0", [0]),
                            ("stdout", "rank 1", [1]), ("stdout", "b", [0, 1])]
    assert render_text(model).splitlines() == ["[0-1] a", "[0]   rank 0", "[1]   rank 1", "[0-1] b"]


def test_per_rank_order_is_never_violated():
    model = OutputGroups([0, 1, 2])
    model.add(0, "stdout", "A\nB\nC\n")
    model.add(1, "stdout", "B\nA\nC\n")
    model.add(2, "stdout", "C\nA\n")
    for finished in (False, True):
        if finished:
            model.finish()
        for rank, printed in ((0, ["A", "B", "C"]), (1, ["B", "A", "C"]), (2, ["C", "A"])):
            assert [g.text for g in model.groups if rank in g.ranks] == printed


def test_repeated_lines_from_one_rank_stay_separate():
    model = OutputGroups([0, 1])
    model.add(0, "stdout", "x\nx\n")
    model.add(1, "stdout", "x\nx\n")
    assert lines(model) == [("stdout", "x", [0, 1]), ("stdout", "x", [0, 1])]


def test_no_dedupe_shows_every_line():
    model = OutputGroups([0, 1], dedupe=False)
    model.add(0, "stdout", "x\n")
    model.add(1, "stdout", "x\n")
    assert lines(model) == [("stdout", "x", [0]), ("stdout", "x", [1])]


def test_partial_lines_wait_for_newline_or_finish():
    model = OutputGroups([0])
    model.add(0, "stdout", "progress ")
    assert model.groups == []
    model.add(0, "stdout", "50%\nnext")
    assert [g.text for g in model.groups] == ["progress 50%"]
    model.finish_rank(0)
    assert [g.text for g in model.groups] == ["progress 50%", "next"]


def test_stderr_is_grouped_apart_from_stdout():
    model = OutputGroups([0, 1])
    model.add(0, "stdout", "same\n")
    model.add(1, "stderr", "same\n")
    assert lines(model) == [("stdout", "same", [0]), ("stderr", "same", [1])]
    assert render_text(model).splitlines() == ["[0] same", "[1]:same"]


def test_settled_prefix_advances_as_ranks_pass_or_finish():
    model = OutputGroups([0, 1])
    model.add(0, "stdout", "a\nb\n")
    assert model.settled() == 0  # rank 1 may still print "a"
    model.add(1, "stdout", "a\n")
    assert model.settled() == 1
    model.finish_rank(1)
    assert model.settled() == 2


def test_output_beyond_the_cap_is_counted_not_shown():
    model = OutputGroups([0], dedupe=False)
    model.add(0, "stdout", "".join(f"{i}\n" for i in range(MAX_SHOWN_LINES + 5)))
    assert len(model.groups) == MAX_SHOWN_LINES
    assert model.dropped_lines == 5
    assert "5 more lines" in render_text(model)


def test_html_escapes_and_marks_streams():
    model = OutputGroups([0])
    model.add(0, "stderr", "<b>oops</b>\n")
    model.notice(0, "rank 0 died")
    out = render_html(model)
    assert "&lt;b&gt;oops&lt;/b&gt;" in out and "rank 0 died" in out


def test_carriage_returns_rewrite_a_line_as_in_a_terminal():
    model = OutputGroups([0, 1])
    for rank in (0, 1):
        model.add(rank, "stderr", "\rtrain 10%\rtrain 50%")
        model.add(rank, "stderr", "\rtrain 100%\n")
    assert lines(model) == [("stderr", "train 100%", [0, 1])]


def test_unfinished_lines_show_live_after_the_others():
    model = OutputGroups([0, 1, 2])
    model.add(0, "stdout", "epoch 1\n")
    before = model.version
    model.add(0, "stderr", "\rtrain 10%")
    model.add(1, "stderr", "\rtrain 10%")
    model.add(2, "stderr", "\rtrain 20%")
    assert model.version > before  # a live view redraws the bars
    assert [(g.stream, g.text, g.ranks) for g in model.open_lines()] == [
        ("stderr", "train 10%", [0, 1]), ("stderr", "train 20%", [2])]
    assert render_text(model).splitlines() == ["[0]   epoch 1", "[0-1]:train 10%", "[2]  :train 20%"]
    assert "train 20%" in render_html(model)
    model.add(2, "stderr", "\rtrain 30%")
    assert model.open_lines()[-1].text == "train 30%"
    model.finish()  # unfinished lines become lines, in their last state
    assert model.open_lines() == []
    assert [g.text for g in model.groups] == ["epoch 1", "train 10%", "train 30%"]


def test_a_line_without_end_is_kept_bounded_and_costs_linear_time():
    """F12: 32 MiB without a newline copied the growing open line at every 64 KiB chunk."""
    from monarch_kernel.core.termtext import OPEN_LINE_MAX

    model = OutputGroups([0, 1])
    chunk = "x" * (64 << 10)
    for _ in range(512):  # 32 MiB in 64 KiB reads, as the agent forwards fd output
        model.add(0, "stdout", chunk)
    assert max(len(g.text) for g in model.open_lines()) == OPEN_LINE_MAX
    model.add(0, "stdout", "\n" + "y" * (OPEN_LINE_MAX * 2) + "\n")
    assert [len(g.text) for g in model.groups] == [OPEN_LINE_MAX, OPEN_LINE_MAX]
    assert model.dropped_chars == (32 << 20) - OPEN_LINE_MAX + OPEN_LINE_MAX  # the end of each long line
    assert "characters of lines longer than" in render_text(model)


def test_groups_of_128_ranks_are_named_compactly():
    ranks = list(range(128))
    model = OutputGroups(ranks)
    for r in ranks:
        model.add(r, "stdout", "loss 0.25\n" if r != 64 else "loss nan\n")
        model.add(r, "stdout", f"{'even' if r % 2 == 0 else 'odd'}\n")
        model.add(r, "stdout", "done\n")
    model.finish()
    lines = [" ".join(line.split()) for line in render_text(model).splitlines()]  # (tags are padded)
    assert lines == ["[all but 64] loss 0.25", "[64] loss nan", "[0-126 step 2] even", "[1-127 step 2] odd",
                     "[0-127] done"]  # never a list of 64 numbers


def test_ranks_whose_lines_differ_around_notices_are_realigned():
    """A notice (a rank not answering heartbeats, say) among lines that differ by rank: the final
    regrouping compared groups it could not hash, and the cell ended in a TypeError."""
    from monarch_kernel.views.output import OutputGroups

    model = OutputGroups((0, 1), dedupe=True)
    model.add(0, "stdout", "a\nonly rank 0\n")
    model.notice(1, "rank 1 is not answering heartbeats")
    model.add(1, "stdout", "a\n")
    model.notice(0, "rank 0 is slow")
    model.finish()
    assert [(g.text, g.ranks) for g in model.groups if g.stream != "notice"][0] == ("a", [0, 1])
