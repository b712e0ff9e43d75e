"""Ids of requests, calls and ports: each process counts from the microsecond it began.

A mesh can outlive the kernel that started it (`persist`), and ranks remember stops and
cancels by id. A kernel that attaches later therefore never reuses an id an earlier one
gave: it started counting later, and no kernel gives more than one id per microsecond.
"""

from __future__ import annotations

import itertools
import time


def fresh_ids() -> itertools.count[int]:
    """A counter of ids above every id an earlier process could have given."""
    return itertools.count(time.time_ns() // 1000)
