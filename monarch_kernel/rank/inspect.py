"""What a rank says of itself when inspected (`%mesh why`, `%mesh stacks`, a hang seen live): its
main thread's stack, the stacks of the endpoints running on their actors' own threads, its other
threads' on request, and its collectives' progress. Built on the
rank's reader thread, so it answers while the main thread waits in a C call that let the GIL go
(a collective, a sleep); a C call holding the GIL keeps it from answering at all."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from types import FrameType

from monarch_kernel.core.hangs import CELL_PREFIX, Frame, RankReport
from monarch_kernel.core.package import PACKAGE_DIR
from monarch_kernel.rank import collectives
from monarch_kernel.rank.user_threads import OWN_THREAD_PREFIX

_LIBRARY_DIRS = tuple({os.path.realpath(p) for p in (sysconfig.get_paths().get("stdlib", ""),
                                                      sysconfig.get_paths().get("purelib", ""),
                                                      sysconfig.get_paths().get("platlib", ""),
                                                      sys.prefix, sys.base_prefix, PACKAGE_DIR) if p})
MAX_FRAMES = 60


def inspect(rank: int, running: str, all_threads: bool = False, stacks_only: bool = False,
            counters_only: bool = False) -> RankReport:
    """This rank's report now (any thread but the main one); `stacks_only`: without collectives;
    `counters_only`: the groups' counters alone (cheap: no entries of the flight recorder)."""
    frames = sys._current_frames()
    main = threading.main_thread()
    stack = _frames(frames.get(main.ident or 0))
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = tuple((names.get(ident, f"thread {ident}"), stack)
                    for ident, stack in ((ident, _frames(top)) for ident, top in sorted(frames.items())
                                         if ident not in (main.ident, me))
                    if all_threads or _runs_an_endpoint(names.get(ident, ""), stack))
    groups, why_not = ((), "not asked") if stacks_only else collectives.progress(with_entries=not counters_only)
    return RankReport(rank, running, stack, groups, threads, why_not)


def _runs_an_endpoint(name: str, stack: tuple[Frame, ...]) -> bool:
    """Whether a thread is an actor's own thread running user code (shown without being asked)."""
    return name.startswith(OWN_THREAD_PREFIX) and any(frame.user for frame in stack)


def _frames(top: FrameType | None) -> tuple[Frame, ...]:
    out: list[Frame] = []
    while top is not None and len(out) < MAX_FRAMES:
        code = top.f_code
        lineno = top.f_lineno or 0  # (None while a frame is between instructions of its own)
        out.append(Frame(code.co_filename, lineno, code.co_name,
                         linecache.getline(code.co_filename, lineno).rstrip("\n") if lineno else "",
                         _is_user(code.co_filename)))
        top = top.f_back
    return tuple(reversed(out))


def _is_user(filename: str) -> bool:
    if filename.startswith(CELL_PREFIX):
        return True
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    real = os.path.realpath(filename)
    return not any(real.startswith(d + os.sep) or real == d for d in _LIBRARY_DIRS)
