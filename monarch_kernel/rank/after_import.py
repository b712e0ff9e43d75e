"""Run a function right after a module is first imported (a rank that started without torch).

A rank forked without torch loaded sets torch up (its device, thread count, the mesh's
`init_process_group`) the moment user code first imports it, not at start-up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once `name` has been imported (now, if it already is)."""
    if name in sys.modules:
        _call(callback, sys.modules[name])
        return
    sys.meta_path.insert(0, _Finder(name, callback))


def _call(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # noqa: BLE001 - the user's import must still work
        print(f"monarch_kernel: setting up {module.__name__} on this rank failed (the import itself worked):\n"
              f"{traceback.format_exc()}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `name` with the other finders and wraps its loader; then steps aside."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self.callback)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, with the callback after it has run the module."""

    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[ModuleType], None]):
        self.inner = inner
        self.callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner  # what asks the module later sees its own loader
        self.inner.exec_module(module)
        _call(self.callback, module)

    def __getattr__(self, attribute: str) -> Any:  # resource readers and the like
        return getattr(self.inner, attribute)
