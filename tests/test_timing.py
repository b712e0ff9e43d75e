"""The per-rank timing view: bars, stragglers, failures."""

import pytest

from monarch_kernel.views.timing import RankTime, TimingView

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def test_stragglers_and_failures_are_marked():
    view = TimingView("cell 3 per rank", [RankTime(0, "a:0", 1.0, True), RankTime(1, "a:1", 1.1, True),
                                          RankTime(2, "b:0", 2.0, True), RankTime(3, "b:1", None, False),
                                          RankTime(4, "c:0", 0.9, False)])
    assert view.median == 1.05 and view.stragglers() == [2]
    lines = view.text().splitlines()
    assert lines[0] == "cell 3 per rank: median 1.05 s"
    assert lines[3].endswith("2.00 s  <- straggler, 1.9x median") and lines[3].count("#") == 30
    assert lines[4].endswith("-  <- no answer (died or lost)")
    assert lines[5].endswith("<- failed")
    page = view.html()
    assert page.count("mk-timing-row") == 5 and "#ff7f0e" in page and "#d62728" in page


def test_small_differences_are_not_stragglers():
    view = TimingView("t", [RankTime(r, f"h:{r}", s, True) for r, s in enumerate([0.001, 0.001, 0.004, 0.001])])
    assert view.stragglers() == []
