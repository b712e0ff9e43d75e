"""`python -m monarch_kernel.planner.estimate_job`: estimate one layout in a process of its own.

The job (on stdin: the notebook's sys.path, then, cloudpickled, a TrainingSpec, the global batch
and a layout string) runs `estimate_layout`, which makes torch's fake process group its default
group; the LayoutEstimate goes back pickled on stdout. A process per layout keeps the
notebook light, and the layouts run in parallel.
"""

from __future__ import annotations

import pickle
import sys
import traceback
import warnings


def main() -> None:
    """Read the job, estimate, write the result."""
    import cloudpickle

    outer = pickle.loads(sys.stdin.buffer.read())  # plain data: the paths first, so that what the
    for path in reversed(outer["sys_path"]):  # payload names by reference can be imported from them
        if path not in sys.path:
            sys.path.insert(0, path)
    job = cloudpickle.loads(outer["payload"])
    from monarch_kernel.planner.estimate import LayoutEstimate, estimate_layout
    from monarch_kernel.planner.layout import Layout

    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # what the model prints must not mix with the result
    warnings.simplefilter("ignore")
    try:
        result = estimate_layout(job["spec"], job["batch"], Layout.parse(job["layout"]),
                                 per_module=job.get("per_module", False))
    except Exception as exc:  # noqa: BLE001 - the notebook shows why this layout could not be estimated
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
        result = LayoutEstimate(job["layout"], error=f"{type(exc).__name__}: {exc}{where}")
    out.write(pickle.dumps(result))
    out.flush()


if __name__ == "__main__":
    main()
