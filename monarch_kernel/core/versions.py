"""What a process runs: its Python and the versions of the packages that must match across a mesh."""

from __future__ import annotations

import importlib
import platform

PACKAGES = ("torch", "cloudpickle", "monarch_kernel")


def versions(_worker: object = None) -> dict[str, str]:
    """This process's Python and package versions ("-" for a package it cannot import).

    (A rank calls it as fn(worker), so it takes and ignores one argument.)
    """
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except ImportError:
            found[name] = "-"
    return found
