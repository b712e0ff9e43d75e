"""The plan's estimates, run in helper processes beside the notebook (`planner/estimate_job.py`):
a few helpers, each importing torch once and forking a fresh child per layout, take the layouts
from one queue, the costliest first (pipelines, then tensor parallelism), so the slowest do not
start last. The notebook allocates nothing of the model and stays responsive to an interrupt,
which stops the helpers."""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from monarch_kernel.planner.apply import TrainingSpec
from monarch_kernel.planner.estimate import LayoutEstimate
from monarch_kernel.planner.estimate_job import read_frame, write_frame
from monarch_kernel.planner.flops import ModelFlops
from monarch_kernel.planner.layout import Layout


def _start_helper() -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    helper = subprocess.Popen([sys.executable, "-m", "monarch_kernel.planner.estimate_job"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert helper.stdin is not None
    write_frame(helper.stdin, pickle.dumps({"sys_path": list(sys.path)}))
    return helper


def _stop(helper: subprocess.Popen[bytes]) -> None:
    try:
        if helper.stdin is not None:
            helper.stdin.close()  # the end of its jobs: it leaves
        helper.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        helper.kill()
        helper.wait()


def run_estimates(spec: TrainingSpec, batch: Any, layouts: Sequence[Layout], workers: int | None = None,
                  per_module: bool = False, timeout: float = 1800.0,
                  device_type: str = "cuda") -> tuple[list[LayoutEstimate], ModelFlops]:
    """Each layout's estimate (in the order given) and the model's FLOPs (`flops.py`), `workers`
    helpers at a time (default: one per core), for ranks of `device_type` ("cuda" or "cpu")."""
    import cloudpickle

    texts = [layout.text for layout in layouts] + [""]  # "": the FLOPs, counted beside the estimates
    results: list[Any] = [None] * len(texts)
    todo: queue.Queue[int] = queue.Queue()
    by_cost = sorted(range(len(layouts)), key=lambda i: (-layouts[i].pp, layouts[i].tp == 1))
    for index in by_cost[:1] + [len(layouts)] + by_cost[1:]:
        todo.put(index)
    helpers: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()

    def serve() -> None:
        helper: subprocess.Popen[bytes] | None = None
        try:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                layout = texts[index]
                if helper is None:
                    helper = _start_helper()
                    with lock:
                        helpers.append(helper)
                payload = cloudpickle.dumps({"spec": spec, "batch": batch, "layout": layout, "per_module": per_module,
                                             "layouts": [] if layout else texts[:-1], "device_type": device_type})
                frame = None
                try:
                    assert helper.stdin is not None and helper.stdout is not None
                    write_frame(helper.stdin, pickle.dumps({"payload": payload, "layout": layout, "timeout": timeout}))
                    frame = read_frame(helper.stdout)
                    why = "the estimate's helper process ended unexpectedly"
                except Exception as exc:  # noqa: BLE001 - whatever the reader met, the layout says why
                    why = f"the estimate's helper process sent something unreadable ({type(exc).__name__}: {exc})"
                if frame is None:
                    results[index] = LayoutEstimate(layout, error=why) if layout else ModelFlops(0.0, "", error=why)
                    helper.kill()
                    helper = None
                else:
                    results[index] = pickle.loads(frame)
        finally:
            if helper is not None:
                _stop(helper)

    count = workers or max(1, min(len(texts), os.cpu_count() or 1))
    threads = [threading.Thread(target=serve, name=f"plan-estimates-{i}", daemon=True) for i in range(count)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:  # an interrupt: the helpers go with it
        with lock:
            for helper in helpers:
                if helper.poll() is None:
                    helper.kill()
    estimates = [r if r is not None else LayoutEstimate(texts[i], error="not estimated")
                 for i, r in enumerate(results[:-1])]
    return estimates, results[-1] if results[-1] is not None else ModelFlops(0.0, "", error="not counted")
