"""A rank's exit work: what an interpreter's exit does for the user's code, done when the rank's processes
are stopped in order (`ProcMesh.stop()`, after its actors' `__cleanup__`).

A rank is a process forked from its host's agent, and it ends with `os._exit`: a full interpreter exit
there would run the agent's own clean-up, inherited with the fork. So neither the exit handlers that the
user's code registered (`atexit`: a tracker's last upload, a profiler's dump) nor the finalizers of what
its modules hold (a global file object's `__del__` that writes its buffer out) would run. Here they do:

- as the rank starts (`forget_the_agents`), the agent's exit handlers are dropped: they are the agent's;
- `run_exit_work` runs the exit handlers registered since (newest first), then drops the globals of the
  user's modules (those not installed with Python or in its environments: the project's, a synced
  workspace's, a script's folder), newest first, and of the rank's `__main__` (the cells'), as Python's
  exit does (each name set to None, so their objects' finalizers run), and collects the cycles left.

Our own modules and installed libraries are left as they are: the rank still answers, and the notebook
then ends the processes.
"""

from __future__ import annotations

import atexit
import gc
import os
import site
import sys
import sysconfig
from typing import Any


def forget_the_agents() -> None:
    """In a rank just forked from its agent: drop the agent's exit handlers (a rank never runs them)."""
    atexit._clear()


def run_exit_work(main_namespace: dict[str, Any]) -> None:
    """The user's exit handlers, then the finalizers of their modules' and cells' globals (see the module's
    note). What a finalizer raises is printed (as Python does at exit) and the rest still run."""
    atexit._run_exitfuncs()  # (it prints what a handler raises, and goes on)
    installed = _installed_roots()
    for name in reversed(list(sys.modules)):
        module = sys.modules.get(name)
        if module is not None and _users(name, module, installed):
            _drop_globals(module.__dict__)
    _drop_globals(main_namespace)
    gc.collect()


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {*site.getsitepackages(), site.getusersitepackages()}  # (pip install --user: installed too)
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots if root)


def _users(name: str, module: Any, installed: tuple[str, ...]) -> bool:
    """Whether `module` is the user's: a file of theirs, not ours, not installed with Python or a library."""
    if name.split(".")[0] == "monarch_kernel" or name == "__main__":
        return False
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return False  # (built in, or made at run time)
    return not os.path.realpath(file).startswith(installed)


def _drop_globals(namespace: dict[str, Any]) -> None:
    for key in list(namespace):
        if not (key.startswith("__") and key.endswith("__")):  # (__builtins__, __name__: finalizers use them)
            namespace[key] = None
