"""Autoreload on a rank: modules under the synced workspaces reload before each cell, in place.

IPython's `superreload` does the reload, so functions and classes are updated where they
are (an object made before the edit sees the new methods), as with `%autoreload 2` in a
notebook; only modules whose file lies under a workspace folder are looked at. A module
that fails to reload is reported with the rank and the file, and its old code keeps running.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


class Reloader:
    """The modules of some folders, reloaded when their files change."""

    def __init__(self, rank: int):
        self.rank = rank
        self.enabled = False
        self.roots: list[str] = []
        self._mtimes: dict[str, int] = {}
        self._old_objects: dict[Any, Any] = {}

    def watch(self, root: str) -> None:
        """Also look at modules under root (a workspace folder on this host)."""
        real = os.path.realpath(root)
        if real not in self.roots:
            self.roots.append(real)
        self._remember()

    def enable(self, on: bool) -> None:
        """Turn reloading on (what is loaded now counts as current) or off."""
        self.enabled = on
        self._remember()

    def _watched(self) -> list[tuple[str, Any, str]]:
        out = []
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if not file or not file.endswith(".py"):
                continue
            real = os.path.realpath(file)
            if any(real.startswith(root + os.sep) for root in self.roots):
                out.append((name, module, real))
        return out

    def after_cell(self) -> None:
        """Modules a cell imported are current as of now (their next change is an edit to reload)."""
        if self.enabled:
            self._remember()

    def _remember(self) -> None:
        for name, _module, file in self._watched():
            try:
                self._mtimes.setdefault(name, os.stat(file).st_mtime_ns)
            except OSError:
                pass

    def check(self, report: Callable[[str], None]) -> list[str]:
        """Reload what changed since the last check; the names reloaded."""
        if not self.enabled or not self.roots:
            return []
        from IPython.extensions.autoreload import superreload

        reloaded = []
        for name, module, file in self._watched():
            try:
                mtime = os.stat(file).st_mtime_ns
            except OSError:
                continue
            if self._mtimes.get(name) == mtime:
                continue
            first_sight = name not in self._mtimes
            self._mtimes[name] = mtime
            if first_sight:  # imported since the last check: it is current
                continue
            try:
                superreload(module, old_objects=self._old_objects)
                reloaded.append(name)
            except Exception:  # noqa: BLE001 - reported; the old code keeps running
                # (the rank's own prefix names it; the same text on every rank is shown once)
                report(f"autoreload: module {name} ({file}) failed to reload; its old code keeps running "
                       f"until the file is fixed:\n{traceback.format_exc(limit=-3)}")
        return reloaded
