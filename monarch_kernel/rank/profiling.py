"""`%%mesh --profile`: torch.profiler around one cell on this rank (started and stopped by the
notebook's `StartProfile`/`StopProfile` operations around the cell), its trace and the time of
its top operations; and a reading of this rank's clock, so the notebook can line the ranks'
traces up."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from monarch_kernel.wire.ops import ProfileTrace

TOP_OPERATIONS = 30
_running: list[Any] = []  # the profiler of the cell being profiled on this rank


def start() -> bool:
    """Start torch.profiler on this rank (CPU, and CUDA where there is a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    stop_quietly()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    with _quiet_stderr():  # (kineto says "profiler_start" on fd 2: not the user's output)
        profiler.__enter__()
    _running.append(profiler)
    return True


def stop() -> ProfileTrace:
    """Stop it; this rank's chrome trace (its events and its time base) and its top operations by self time."""
    if not _running:
        raise RuntimeError("no profile is running on this rank")
    profiler = _running.pop()
    with _quiet_stderr():
        profiler.__exit__(None, None, None)
    fd, path = tempfile.mkstemp(prefix="monarch-profile-", suffix=".json")
    os.close(fd)
    try:
        profiler.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    averages = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPERATIONS]
    return ProfileTrace(trace.get("traceEvents", []), int(trace.get("baseTimeNanoseconds", 0)) / 1000,
                        [(e.key, int(e.count), float(e.self_cpu_time_total)) for e in averages])


def stop_quietly() -> None:
    """End a profile left running (a cell that was stopped before its profile was read)."""
    while _running:
        with contextlib.suppress(Exception), _quiet_stderr():
            _running.pop().__exit__(None, None, None)


def clock_us() -> float:
    """This rank's wall clock, in microseconds."""
    return time.time_ns() / 1000


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
