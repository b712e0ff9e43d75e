"""Running a script file on a rank as torchrun would: `__main__`, `sys.argv`, its folder on `sys.path`.

Each run gets a fresh `__main__` module (the cells' namespace is left alone and comes back
afterwards). `sys.exit(0)` (argparse's `--help`, a script's normal end) is a success; any
other exit status fails the run with that status. A traceback starts at the script's own
frames, not at the machinery that started it.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import types


class ScriptExit(Exception):
    """The script ended with a non-zero exit status."""


def run_script(path: str, argv: list[str], cwd: str | None = None) -> None:
    """Run the script at path (as `python path *argv`, from folder cwd if given) in this rank's process."""
    saved_cwd = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        _run(path, argv)
    finally:
        os.chdir(saved_cwd)


def _run(path: str, argv: list[str]) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is not a file on {socket.gethostname()} (working folder {os.getcwd()}): the script must "
            "be reachable on every host; copy it there or keep it on a shared filesystem")
    full = os.path.abspath(path)
    saved_argv, saved_path, saved_main = sys.argv, list(sys.path), sys.modules.get("__main__")
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(full))
    try:
        runpy.run_path(full, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptExit(f"{path} exited with status {exc.code!r}") from None
    except BaseException as exc:  # noqa: BLE001 - re-raised as it is, from the script's first frame
        raise exc.with_traceback(_from_script(exc.__traceback__, full))  # noqa: B904 - the same exception
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def _from_script(tb: types.TracebackType | None, full: str) -> types.TracebackType | None:
    """The traceback from the script's first frame on (runpy's frames left out)."""
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename != full:
        start = start.tb_next
    return start or tb
