"""User code's exceptions as wire Failures: type, message and a traceback without our frames.

Every process that runs user code (ranks; ports sending an error from anywhere) reports
failures this way.
"""

from __future__ import annotations

import traceback

from monarch_kernel.core.package import PACKAGE_DIR
from monarch_kernel.wire.messages import Failure


def describe_failure(exc: BaseException) -> Failure:
    """Format an exception raised by user code, without our own frames."""
    if isinstance(exc, SystemExit):
        return Failure(
            "SystemExit",
            f"the cell called sys.exit({exc.code!r}); the rank keeps running",
            "",
        )
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    _drop_own_frames(te)
    lines = list(te.format())
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return Failure(
        type(exc).__name__,
        message,
        "".join(lines),
        interrupted=isinstance(exc, KeyboardInterrupt),
    )


def _drop_own_frames(first: traceback.TracebackException) -> None:
    """Remove monarch_kernel's own frames (dispatch, signal handler) from a traceback."""
    seen: set[int] = set()
    te: traceback.TracebackException | None = first
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not f.filename.startswith(PACKAGE_DIR)])
        te = te.__cause__ or te.__context__
