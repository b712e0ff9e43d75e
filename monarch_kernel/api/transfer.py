"""`Mesh.put` and `Mesh.get`: files and folders to every host, and back from every host or rank.

The bytes move over the mesh's own agent connections, once per host, all hosts at once,
in checksummed chunks (`controller.file_transfer`); an interrupted transfer goes on from
where it stopped the next time. What comes back lands under the folder the user named,
as `NAME.host-H` (the ranks of a host share a path) or, when the path names `{rank}` or
`{local_rank}`, as `NAME.rank-R`; names that come back from a host are checked so that
nothing lands outside that folder.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.api.progress import progress_line, show_stdout, size_text, wait_showing
from monarch_kernel.controller.file_transfer import TransferResult, get_host, put_host
from monarch_kernel.controller.host_ops import HostOpFailed, Progress
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.core.errors import MeshUsageError

PLACEHOLDERS = ("{rank}", "{local_rank}")


@dataclass
class TransferReport:
    """What a put or get did, per host (or per rank)."""

    verb: str
    source: str
    results: list[TransferResult]
    seconds: float

    @property
    def errors(self) -> list[str]:
        """Every problem, prefixed with its host."""
        return [f"{r.host}: {e}" for r in self.results for e in r.errors]

    @property
    def files(self) -> list[str]:
        """Where every file landed."""
        return [f for r in self.results for f in r.files]

    @property
    def bytes_moved(self) -> int:
        """Bytes that travelled (all hosts together; resumed bytes not counted)."""
        return sum(r.bytes_moved for r in self.results)

    def summary(self) -> str:
        """One line (and one per problem)."""
        rate = self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0
        resumed = sum(r.bytes_resumed for r in self.results)
        line = (f"{self.verb} {self.source}: {len(self.files)} file{'s' * (len(self.files) != 1)}, "
                f"{size_text(self.bytes_moved)} moved in {self.seconds:.2f} s ({rate:.2f} GB/s), sha256 checked"
                + (f", {size_text(resumed)} resumed from an interrupted transfer" if resumed else ""))
        return "\n  ! ".join([line, *self.errors])

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.summary())


def _check_host_path(path: str, what: str) -> None:
    if not (path.startswith("/") or path.startswith("~")):
        raise MeshUsageError(f"{what} {path!r}: give an absolute path on the hosts (or ~/...): a relative one "
                             "would depend on each host's working folder")


def put(runtime: MeshRuntime, src: str, dst: str, ranks: list[int],
        show: Callable[[str], None] = show_stdout) -> TransferReport:
    """Copy a local file or folder to path `dst` on every host of `ranks` (see `Mesh.put`)."""
    _require_open(runtime)
    local = os.path.realpath(os.path.expanduser(src))
    if not os.path.exists(local):
        raise MeshUsageError(f"cannot put {src}: no such file or folder here")
    _check_host_path(dst, "put destination")
    links = [link for link in runtime.state.links if any(r in ranks for r in link.ranks)]
    progress = {link.name: Progress() for link in links}
    jobs = [put_host(runtime.host_ops, link, local, dst, progress[link.name]) for link in links]
    return _run(runtime, "put", src, [link.name for link in links], jobs, progress, show)


def get(runtime: MeshRuntime, src: str, dst_dir: str, ranks: list[int],
        show: Callable[[str], None] = show_stdout) -> TransferReport:
    """Copy path `src` from the hosts of `ranks` (per rank if it names {rank}) into local folder `dst_dir`."""
    _require_open(runtime)
    _check_host_path(src, "get source")
    folder = os.path.realpath(os.path.expanduser(dst_dir))
    os.makedirs(folder, exist_ok=True)
    per_rank = any(p in src for p in PLACEHOLDERS)
    units = []  # (link, remote path, local path, label)
    for link in runtime.state.links:
        mine = [r for r in link.ranks if r in ranks]
        if not mine:
            continue
        if per_rank:
            for rank in mine:
                remote = src.replace("{rank}", str(rank)).replace("{local_rank}", str(link.ranks.index(rank)))
                units.append((link, remote, os.path.join(folder, f"{_name(remote)}.rank-{rank}"), f"rank {rank}"))
        else:
            units.append((link, src, os.path.join(folder, f"{_name(src)}.host-{link.index}"), link.name))
    progress = {label: Progress() for _, _, _, label in units}
    jobs = [get_host(runtime.host_ops, link, remote, local, progress[label]) for link, remote, local, label in units]
    return _run(runtime, "got", src, [label for *_, label in units], jobs, progress, show)


def _require_open(runtime: MeshRuntime) -> None:
    if runtime.closed:
        raise MeshUsageError(f"mesh {runtime.name!r} is shut down; start it again first")


def _name(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    if name in ("", ".", "..", "~"):
        raise MeshUsageError(f"{path!r} does not end in a file or folder name")
    return name


def _run(runtime: MeshRuntime, verb: str, source: str, labels: list[str], jobs: list[Any],
         progress: dict[str, Progress], show: Callable[[str], None]) -> TransferReport:
    started = time.monotonic()

    async def every() -> list[Any]:
        return await asyncio.gather(*jobs, return_exceptions=True)

    done = wait_showing(runtime.controller.run(every()), lambda: progress_line(f"{verb[:3]} {source}", progress),
                        f"{verb} {source}", show)
    results = []
    for label, outcome in zip(labels, done):
        if isinstance(outcome, TransferResult):
            outcome.host = label
            results.append(outcome)
        else:
            why = str(outcome) if isinstance(outcome, HostOpFailed) else f"{type(outcome).__name__}: {outcome}"
            results.append(TransferResult(label, errors=[why]))
    report = TransferReport(verb, source, results, time.monotonic() - started)
    show(report.summary() + "\n")
    return report
