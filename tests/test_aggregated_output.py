"""Ranks' output outside cells in windows of similar lines (`api/aggregated_output.py`, Monarch's
`ProcMesh.logging_option(aggregate_window_sec=...)`), and the modes of `api.sinks.IdleOutput`."""

from __future__ import annotations

import io
import random
import re
import sys
import threading

import pytest
from conftest import wait_until

from monarch_kernel.api.aggregated_output import SIMILAR_BELOW, AggregatedOutput, similar
from monarch_kernel.api.sinks import IdleOutput

pytestmark = pytest.mark.unit


def levenshtein(left: str, right: str) -> int:
    """The plain full-table edit distance (the reference the banded one is checked against)."""
    previous = list(range(len(right) + 1))
    for i, a in enumerate(left, 1):
        current = [i]
        for j, b in enumerate(right, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a != b)))
        previous = current
    return previous[-1]


def test_similar_agrees_with_the_full_edit_distance_on_random_lines():
    rng = random.Random(7)
    for _ in range(3000):
        base = "".join(rng.choice("ab c1") for _ in range(rng.randint(0, 40)))
        other = list(base)
        for _ in range(rng.randint(0, 8)):  # a few edits of each kind
            at = rng.randint(0, len(other))
            match rng.randint(0, 2):
                case 0:
                    other.insert(at, rng.choice("ab c1"))
                case 1 if other:
                    other.pop(min(at, len(other) - 1))
                case _ if other:
                    other[min(at, len(other) - 1)] = rng.choice("ab c1")
        right = "".join(other)
        longest = max(len(base), len(right))
        expected = longest == 0 or levenshtein(base, right) < SIMILAR_BELOW * longest
        assert similar(base, right) == expected, (base, right)


def test_lines_that_differ_in_a_rank_or_a_number_are_one_group_and_others_are_not():
    assert similar("[rank 0] step 812 loss 2.31", "[rank 13] step 812 loss 2.30")
    assert not similar("[rank 0] step 812 loss 2.31", "[rank 0] saved checkpoint to /ckpt/812")
    assert similar("x" * 4000 + "a", "x" * 4000 + "b")  # (long lines stay cheap: a band of the table)


def streams():
    out = {"stdout": io.StringIO(), "stderr": io.StringIO()}
    return out, out.__getitem__


def test_a_window_shows_each_group_once_with_its_count_on_its_own_stream():
    out, pick = streams()
    window = AggregatedOutput("mesh 'train'", 3600, pick)
    for rank in range(4):
        window.add("stdout", f"[rank {rank}] step 7 loss 2.5")
        window.add("stderr", f"[rank {rank}] WARNING: slow data loader")
    window.add("stdout", "[rank 0] saved checkpoint")
    assert out["stdout"].getvalue() == ""  # (held until the window closes)
    window.flush()
    shown = out["stdout"].getvalue().splitlines()
    assert re.fullmatch(r"\[mesh 'train' \d\d:\d\d:\d\d-\d\d:\d\d:\d\d: 5 lines\]", shown[0]), shown
    assert shown[1:] == ["[4 similar log lines] [rank 0] step 7 loss 2.5", "[1 similar log lines] [rank 0] saved checkpoint"]
    assert out["stderr"].getvalue().splitlines()[1:] == ["[4 similar log lines] [rank 0] WARNING: slow data loader"]
    window.flush()  # nothing waits: nothing more is shown
    assert len(out["stdout"].getvalue().splitlines()) == 3


def test_a_window_closes_by_itself_and_a_shorter_window_closes_the_waiting_one_sooner():
    out, pick = streams()
    window = AggregatedOutput("mesh 'm'", 0.2, pick)
    window.add("stdout", "[rank 0] hello")
    assert wait_until(lambda: "[1 similar log lines] [rank 0] hello" in out["stdout"].getvalue(), 10)
    window.set_window(3600)
    window.add("stdout", "[rank 1] again")
    window.set_window(0.1)  # (the waiting window opened less than 0.1 s ago, or is due now)
    assert wait_until(lambda: "[1 similar log lines] [rank 1] again" in out["stdout"].getvalue(), 10)


def test_idle_output_hidden_one_by_one_or_aggregated_and_the_window_shown_when_aggregation_ends():
    out, err = io.StringIO(), io.StringIO()
    real = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        idle = IdleOutput(label="mesh 'm'")
        idle.write(0, "stdout", "one by one\n")
        idle.set_mode(False, None)
        idle.write(0, "stdout", "not shown\n")
        idle.set_mode(True, 3600)
        for rank in range(2):
            idle.write(rank, "stdout", "together\n")
        assert "together" not in out.getvalue()
        idle.set_mode(True, None)  # the window waiting is shown now, and lines come one by one again
        idle.write(1, "stdout", "after\n")
    finally:
        sys.stdout, sys.stderr = real
    lines = out.getvalue().splitlines()
    assert lines[0] == "[rank 0] one by one" and "not shown" not in out.getvalue()
    assert lines[2:] == ["[2 similar log lines] [rank 0] together", "[rank 1] after"], lines


def test_lines_added_from_many_threads_are_all_counted():
    out, pick = streams()
    window = AggregatedOutput("mesh 'm'", 3600, pick)
    threads = [threading.Thread(target=lambda r=r: [window.add("stdout", f"[rank {r}] tick") for _ in range(200)])
               for r in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    window.flush()
    assert "[1600 similar log lines]" in out["stdout"].getvalue()
