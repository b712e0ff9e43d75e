"""What a process runs: its Python and the versions of the packages that must match across a mesh."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import sys

# The one place monarch_kernel's version lives (the package root and pyproject.toml read it).
# 0.MINOR.PATCH: MINOR rises with each landed set of features, PATCH with fixes alone; a host must
# run the notebook's version (the handshake refuses one that differs, naming both).
__version__ = "0.12.0"

PACKAGES = ("torch", "cloudpickle", "monarch_kernel")


def versions() -> dict[str, str]:
    """This process's Python and package versions ("-" for a package it cannot import)."""
    return {"python": platform.python_version(), **{name: package_version(name) for name in PACKAGES}}


def package_version(name: str) -> str:
    """The version of `name` as this process would import it, without importing it if it is not loaded.

    (A rank started light must not pay torch's import just to be asked its version.)
    """
    module = sys.modules.get(name)
    if module is None and importlib.util.find_spec(name) is None:
        return "-"
    if module is None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # a source folder on sys.path (a shipped package)
            pass
    try:
        return str(getattr(module or importlib.import_module(name), "__version__", "?"))
    except ImportError:
        return "-"
