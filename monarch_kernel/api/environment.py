"""`%mesh env` / `Mesh.environment()`: the Python and package versions of every host next to the notebook's.

A host with another Python or another torch, cloudpickle or monarch_kernel is a common
cause of confusing unpickling errors; remote meshes are checked once at start and warn
only when something differs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from monarch_kernel.api.workspace import AskRanks
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.core.texttable import text_table
from monarch_kernel.core.versions import versions
from monarch_kernel.wire.ops import Versions


@dataclass
class EnvReport:
    """Versions on the notebook's side and on each host, and what differs."""

    notebook: dict[str, str]
    hosts: dict[str, dict[str, str]]

    @property
    def mismatches(self) -> list[str]:
        """One sentence per host and package that differs from the notebook."""
        out = []
        for host, found in self.hosts.items():
            for name, mine in self.notebook.items():
                theirs = found.get(name, "-")
                if name == "python":
                    same = theirs.split(".")[:2] == mine.split(".")[:2]  # pickles cross patch releases
                else:
                    same = theirs == mine
                if not same:
                    out.append(f"{host} has {name} {theirs}, the notebook {mine}")
        return out

    def text(self) -> str:
        """A table, then the mismatches (or a line saying there are none)."""
        names = list(self.notebook)
        rows = [("", *names), ("notebook", *self.notebook.values())]
        rows += [(host, *(found.get(n, "-") for n in names)) for host, found in self.hosts.items()]
        lines = text_table(rows)
        problems = self.mismatches
        if problems:
            lines += [f"warning: {p}" for p in problems]
            lines.append("values pickled on one side may fail to unpickle on the other: install the same versions "
                         "(or start the mesh with --python pointing at a matching interpreter)")
        else:
            lines.append("every host matches the notebook")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())


def check(runtime: MeshRuntime, ask: AskRanks) -> EnvReport:
    """Ask one rank of each host for its versions."""
    firsts = [link.ranks[0] for link in runtime.state.links if link.ranks]
    answers = ask(firsts, Versions(), "environment").by_rank()
    hosts = {link.name: answers.get(link.ranks[0], {}) for link in runtime.state.links if link.ranks}
    return EnvReport(versions(), hosts)


def warn_if_mismatched(runtime: MeshRuntime, ask: AskRanks) -> EnvReport | None:
    """At start: a warning on stderr when a host differs from the notebook (nothing otherwise)."""
    try:
        report = check(runtime, ask)
    except Exception:  # noqa: BLE001 - a check must not stop a mesh that started
        return None
    for problem in report.mismatches:
        sys.stderr.write(f"monarch_kernel warning: mesh {runtime.name!r}: {problem}; values pickled on one side "
                         "may not unpickle on the other (see %mesh env)\n")
    return report
