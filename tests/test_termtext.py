import pytest

from monarch_kernel.core.termtext import LineLog, compact, open_line, progress_chars, shown_line

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def test_a_line_shows_what_follows_its_last_carriage_return():
    assert shown_line("\rstep 1\rstep 2") == "step 2"
    assert shown_line("plain") == "plain"
    assert shown_line("kept\r") == "kept"  # nothing after the return: the text stays on screen
    assert shown_line("a\rb\r\r") == "b"


def test_an_open_line_keeps_only_its_latest_rewrite():
    assert open_line("loading") == "loading"
    assert open_line("50%\r") == "50%\r"  # a later write replaces it
    assert open_line("10%\r20%\r30%") == "\r30%"
    assert shown_line(open_line("10%\r20%") + "\r40%") == "40%"


def test_compact_drops_overwritten_states_line_by_line():
    assert compact("no returns\nhere") == "no returns\nhere"
    assert compact("\r1\r2\r3\ndone\n\r4\r5") == "\r3\ndone\n\r5"
    assert shown_line(compact("\r1\r2\r3\n").split("\n")[0]) == "3"


def test_progress_chars_counts_short_rewrites_only():
    assert progress_chars("\r10%") == 4
    assert progress_chars("line\n\r10%") == 4
    assert progress_chars("\r" + "x" * 5000) == 0  # a huge "rewrite" is output, not a progress bar
    assert progress_chars("no return") == 0


def test_line_log_keeps_complete_lines_and_the_latest_progress_state():
    log = LineLog(maxlen=3)
    log.write("stdout", "epoch 1\n")
    for i in range(100):
        log.write("stderr", f"\rtrain {i}%")
    assert log.tail() == [("stdout", "epoch 1"), ("stderr", "train 99%")]
    log.write("stderr", "\rtrain 100%\nboom\n")
    assert log.texts() == ["epoch 1", "train 100%", "boom"]
    log.write("stdout", "a\nb\n")
    assert log.texts() == ["boom", "a", "b"]  # bounded
    assert log.tail(2) == [("stdout", "a"), ("stdout", "b")]


def test_a_line_that_never_ends_is_kept_bounded():
    """F12: 32 MiB written without a newline grew the open line at every chunk (quadratic)."""
    from monarch_kernel.core.termtext import OPEN_LINE_MAX, LineLog

    log = LineLog(10)
    chunk = "x" * (64 << 10)
    for i in range(512):  # 32 MiB in 64 KiB reads, as the agent gets them
        log.write("stdout", chunk[:-1] + str(i % 10))
    (stream, line), = log.tail()
    assert stream == "stdout" and len(line) == OPEN_LINE_MAX and line.endswith("1")
    log.write("stdout", " done\n")
    assert log.tail()[-1][1].endswith("1 done") and len(log.tail()[-1][1]) <= OPEN_LINE_MAX + 5
