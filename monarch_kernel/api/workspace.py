"""The user's project on every host: `Mesh.sync_workspace` and `Mesh.autoreload` (the notebook's side).

A sync scans the folder here (`controller.workspace_sync.scan`), brings each remote
host's copy level with it, all hosts at once, over the mesh's own agent connections, and
puts the copy first on each rank's `sys.path`. Hosts on this machine share the folder:
nothing is copied for them. With `auto`, files changed since the last sync are sent
before each mesh cell; when nothing changed that costs one stat walk of the folder.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.api.progress import progress_line, show_stdout, size_text, wait_showing
from monarch_kernel.api.session import Session
from monarch_kernel.controller.host_ops import HostOpFailed, Progress
from monarch_kernel.controller.hostspec import HostKind
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.controller.workspace_sync import HostResult, Scan, scan, sync_hosts
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.workspace import workspace_key
from monarch_kernel.wire.ops import RankOperation, SetAutoreload, UseWorkspace

DEFAULT_MAX_BYTES = 1 << 30  # a sync larger than this is refused unless forced (a dataset in the folder?)
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")

# how the API runs a function on some ranks: (ranks, fn(worker), label) -> each rank's value
AskRanks = Callable[[list[int], RankOperation, str], Any]  # runs an operation on these ranks (`Mesh._ask_on`)


@dataclass
class SyncReport:
    """What a sync did: per remote host, and which hosts share the folder."""

    folder: str
    key: str
    hosts: list[HostResult]
    shared_hosts: list[str]
    skipped_links: list[str]
    seconds: float
    auto: bool = False

    @property
    def errors(self) -> list[str]:
        """Every per-file or per-host problem, prefixed with the host."""
        return [f"{h.host}: {e}" for h in self.hosts for e in h.errors]

    @property
    def sent_bytes(self) -> int:
        """Bytes sent, all hosts together."""
        return sum(h.sent_bytes for h in self.hosts)

    def summary(self) -> str:
        """One line (and one per problem)."""
        parts = []
        copies = [h for h in self.hosts if not h.shared_with]
        if copies:
            counts = {(h.sent_files, h.sent_bytes, h.deleted, h.unchanged) for h in copies}
            if len(counts) == 1:
                files, sent, deleted, unchanged = counts.pop()
                parts.append(f"{len(copies)} host{'s' * (len(copies) != 1)}: {files} file"
                             f"{'s' * (files != 1)} ({size_text(sent)}) sent to each, {deleted} deleted, "
                             f"{unchanged} unchanged")
            else:
                parts += [f"{h.host}: {h.sent_files} sent ({size_text(h.sent_bytes)}), {h.deleted} deleted, "
                          f"{h.unchanged} unchanged" for h in copies]
        sharing = [h for h in self.hosts if h.shared_with]
        if sharing:
            parts.append(", ".join(f"{h.host} shares {h.shared_with}'s disk" for h in sharing) + ": written once")
        if self.shared_hosts:
            parts.append(f"{', '.join(self.shared_hosts)} share{'s' * (len(self.shared_hosts) == 1)} this "
                         "filesystem: nothing copied")
        line = f"synced {self.folder} in {self.seconds:.2f} s: " + "; ".join(parts)
        if self.skipped_links:
            line += f"\n  {len(self.skipped_links)} symlink(s) leading outside the folder or in a loop were skipped: " \
                    + ", ".join(self.skipped_links[:5])
        for error in self.errors:
            line += f"\n  ! {error}"
        return line

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.summary())


@dataclass
class SyncedFolder:
    """A folder this mesh keeps in sync, and what its hosts last received."""

    folder: str
    excludes: tuple[str, ...]
    chdir: bool
    auto: bool
    max_bytes: int
    state: dict[str, tuple[int, int, int]] = field(default_factory=dict)


class MeshWorkspaces:
    """The synced folders of one mesh (shared by all its slices)."""

    def __init__(self) -> None:
        self.folders: dict[str, SyncedFolder] = {}
        self.autoreload = False
        self.in_use: set[tuple[str, bool]] = set()  # (folder, chdir) the current ranks have on sys.path
        self.copies: dict[int, dict[str, str]] = {}  # rank -> {folder here: where the rank has it}

    @property
    def auto(self) -> list[SyncedFolder]:
        """Folders synced before each cell."""
        return [f for f in self.folders.values() if f.auto]


def workspaces_of(runtime: MeshRuntime) -> MeshWorkspaces:
    """The synced folders of a mesh (kept by the notebook's session)."""
    return Session.current().of_mesh(runtime, MeshWorkspaces, MeshWorkspaces)


def project_folder(start: str | None = None) -> str:
    """The notebook's folder, or the project root holding it (pyproject.toml, setup.py, .git)."""
    here = os.path.realpath(start or os.getcwd())
    folder = here
    while True:
        if any(os.path.exists(os.path.join(folder, marker)) for marker in PROJECT_MARKERS):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return here
        folder = parent


def sync(runtime: MeshRuntime, ask: AskRanks, path: str | None = None, *, exclude: Iterable[str] = (),
         auto: bool = False, chdir: bool = False, force: bool = False, max_bytes: int = DEFAULT_MAX_BYTES,
         show: Callable[[str], None] | None = None) -> SyncReport:
    """Sync a folder to every host of the mesh and put it on the ranks' sys.path (see `Mesh.sync_workspace`)."""
    if runtime.closed:
        raise MeshUsageError(f"mesh {runtime.name!r} is shut down; start it again before syncing")
    folder = os.path.realpath(os.path.expanduser(path)) if path else project_folder()
    if not os.path.isdir(folder):
        raise MeshUsageError(f"cannot sync {path or folder}: it is not a folder here")
    entry = SyncedFolder(folder, tuple(exclude), chdir, auto, max_bytes)
    report = _sync_folder(runtime, entry, force=force, show=show or show_stdout)
    workspaces = workspaces_of(runtime)
    workspaces.folders[folder] = entry
    if (folder, chdir) not in workspaces.in_use or report.errors:  # a re-sync needs no round trip to the ranks
        _use_on_ranks(runtime, ask, report, chdir)
        workspaces.in_use.add((folder, chdir))
    return report


def sync_changed(runtime: MeshRuntime, show: Callable[[str], None] | None = None) -> list[SyncReport]:
    """Before a cell: send what changed in the auto-synced folders (a stat walk when nothing did)."""
    reports = []
    for entry in workspaces_of(runtime).auto:
        found = scan(entry.folder, entry.excludes)
        if found.quick_state() == entry.state:
            continue
        reports.append(_sync_folder(runtime, entry, force=False, show=show or show_stdout, found=found, auto=True))
    return reports


def reapply(runtime: MeshRuntime, ask: AskRanks) -> None:
    """After a restart: sync again (the hosts may be new: a new Slurm allocation), then the fresh
    ranks get the synced folders on sys.path (and autoreload) again."""
    workspaces = workspaces_of(runtime)
    workspaces.in_use.clear()  # fresh ranks
    workspaces.copies.clear()
    for entry in workspaces.folders.values():
        report = _sync_folder(runtime, entry, force=True, show=show_stdout)
        _use_on_ranks(runtime, ask, report, entry.chdir)
        workspaces.in_use.add((entry.folder, entry.chdir))
    if workspaces.autoreload:
        set_autoreload(runtime, ask, True)


def set_autoreload(runtime: MeshRuntime, ask: AskRanks, on: bool) -> None:
    """Turn autoreload of the synced folders' modules on or off on every rank."""
    workspaces_of(runtime).autoreload = on
    ask(list(runtime.ranks), SetAutoreload(on), "autoreload")


def path_mappings(runtime: MeshRuntime, rank: int) -> list[tuple[str, str]]:
    """(folder here, the rank's copy of it) for each synced folder the rank has elsewhere (a debugger
    maps the notebook's file names to the rank's with these)."""
    copies = workspaces_of(runtime).copies.get(rank, {})
    return [(here, there) for here, there in sorted(copies.items()) if here != there]


def _use_on_ranks(runtime: MeshRuntime, ask: AskRanks, report: SyncReport, chdir: bool) -> None:
    failed_hosts = {h.host for h in report.hosts if h.errors and not h.root}
    copies = workspaces_of(runtime).copies
    for link, spec in zip(runtime.state.links, runtime.spec.hosts):
        if link.name in failed_hosts:
            continue
        where = report.folder if spec.kind == HostKind.LOCAL else None
        used = ask(link.ranks, UseWorkspace(where, report.key, chdir), "use_workspace")
        for rank, folder in used.by_rank().items():
            copies.setdefault(rank, {})[report.folder] = folder


def _sync_folder(runtime: MeshRuntime, entry: SyncedFolder, *, force: bool, show: Callable[[str], None],
                 found: Scan | None = None, auto: bool = False) -> SyncReport:
    started = time.monotonic()
    found = found or scan(entry.folder, entry.excludes)
    if found.total_bytes > entry.max_bytes and not force:
        biggest = ", ".join(f"{rel} ({size_text(size)})" for rel, size in found.largest())
        raise MeshUsageError(
            f"{entry.folder} holds {size_text(found.total_bytes)} to sync, over the {size_text(entry.max_bytes)} guard; "
            f"the largest files: {biggest}. Exclude them (exclude=[...], --exclude, or .gitignore) or pass "
            "force=True (--force)")
    key = workspace_key(entry.folder)
    links = [link for link, spec in zip(runtime.state.links, runtime.spec.hosts) if spec.kind != HostKind.LOCAL]
    shared = [link.name for link, spec in zip(runtime.state.links, runtime.spec.hosts) if spec.kind == HostKind.LOCAL]
    progress = {link.name: Progress() for link in links}

    async def all_hosts() -> list[HostResult | BaseException]:
        return await sync_hosts(runtime.host_ops, links, key, found, progress)

    results: list[HostResult | BaseException] = []
    if links:
        results = wait_showing(runtime.controller.run(all_hosts()),
                               lambda: progress_line(f"syncing {os.path.basename(entry.folder)}", progress),
                               f"the sync of {entry.folder}", show)
    hosts = []
    for link, result in zip(links, results):
        if isinstance(result, HostResult):
            hosts.append(result)
        else:
            why = str(result) if isinstance(result, HostOpFailed) else f"{type(result).__name__}: {result}"
            hosts.append(HostResult(link.name, errors=[f"sync failed: {why}"]))
    states = [h.state for h in hosts if h.root]
    entry.state = found.quick_state() if all(not h.errors for h in hosts) else (states[0] if states else {})
    report = SyncReport(entry.folder, key, hosts, shared, found.skipped_links, time.monotonic() - started, auto)
    show(report.summary() + "\n")
    return report


