"""Workspace sync, the notebook's side: which files a folder holds, and bringing each host's copy level with it.

`scan()` walks the folder on the notebook's machine (`.gitignore` files, excludes, no
symlink that leads outside or loops). `sync_host()` runs on the controller loop, once per
host, all hosts at once: it lists the host's copy, compares by size and mtime (and by
content hash where only the mtime differs), then sends what changed in chunks of at most
CHUNK bytes, a few in flight, reading each file a chunk at a time, and deletes what the
folder no longer has. The agent's side is `agent.workspace`.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.controller.host_ops import HostOps, Progress
from monarch_kernel.controller.state import HostLink
from monarch_kernel.core.workspace import file_sha256
from monarch_kernel.wire.ops import HashFiles, ListFiles, WorkspaceListing, WriteFiles

CHUNK = 8 << 20  # bytes per write operation (small files share one)
BATCH_FILES = 1024  # files per write operation at most (a frame holds 4096 buffers)
OUT_OF_BAND = 64 << 10  # data this large travels as its own buffer, smaller rides inside the frame
WINDOW = 4  # write operations in flight per host
ALWAYS_EXCLUDED = (".git/", "__pycache__/", "*.pyc", ".ipynb_checkpoints/", ".mypy_cache/", ".pytest_cache/",
                   ".ruff_cache/", "*.monarch-partial")


# ---------------------------------------------------------------- what the folder holds


@dataclass(frozen=True)
class LocalFile:
    """One file to sync: where it is here, and what the quick check compares."""

    path: str
    size: int
    mtime_ns: int
    mode: int


@dataclass
class Scan:
    """The files of a folder that sync, by '/'-separated relative path."""

    folder: str
    files: dict[str, LocalFile]
    skipped_links: list[str] = field(default_factory=list)  # symlinks leading outside, or in a loop
    rules: IgnoreRules | None = None  # what the folder leaves out (never deleted on a host either)

    @property
    def total_bytes(self) -> int:
        """The size of every file."""
        return sum(f.size for f in self.files.values())

    def largest(self, count: int = 5) -> list[tuple[str, int]]:
        """The biggest files, for the size guard's message."""
        return sorted(((rel, f.size) for rel, f in self.files.items()), key=lambda item: -item[1])[:count]

    def quick_state(self) -> dict[str, tuple[int, int, int]]:
        """What the quick check compares, per file."""
        return {rel: (f.size, f.mtime_ns, f.mode) for rel, f in self.files.items()}


@dataclass(frozen=True)
class _Rule:
    base: str  # the folder whose .gitignore holds it ("" for the root and for excludes)
    pattern: re.Pattern[str]
    negate: bool
    dir_only: bool


def compile_pattern(line: str, base: str = "") -> _Rule | None:
    """A .gitignore line (or an exclude) as a rule; None for blanks and comments."""
    line = line.rstrip("\n")
    if not line.strip() or line.startswith("#"):
        return None
    line = line.rstrip(" ") if not line.endswith("\\ ") else line
    negate = line.startswith("!")
    if negate:
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    anchored = "/" in line
    line = line.lstrip("/")
    out, i = [], 0
    while i < len(line):
        if line.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif line.startswith("/**", i) and i + 3 == len(line):
            out.append("/.*")
            i += 3
        elif line[i] == "*":
            out.append("[^/]*")
            i += 1
        elif line[i] == "?":
            out.append("[^/]")
            i += 1
        elif line[i] == "[" and (end := line.find("]", i + 2)) != -1:
            body = line[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        elif line[i] == "\\" and i + 1 < len(line):
            out.append(re.escape(line[i + 1]))
            i += 2
        else:
            out.append(re.escape(line[i]))
            i += 1
    prefix = "" if anchored else "(?:.*/)?"
    return _Rule(base, re.compile(prefix + "".join(out) + "$"), negate, dir_only)


class IgnoreRules:
    """Excludes and .gitignore rules; the last rule that matches a path decides (git's order)."""

    def __init__(self, patterns: Iterable[str] = ()):
        self.rules = [rule for p in patterns if (rule := compile_pattern(p)) is not None]

    def add_gitignore(self, base: str, path: str) -> None:
        """The rules of a .gitignore in folder `base` (relative to the root)."""
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError:
            return
        self.rules += [rule for line in lines if (rule := compile_pattern(line, base)) is not None]

    def ignored_path(self, rel: str) -> bool:
        """Whether a file, or any folder above it, is left out."""
        parts = rel.split("/")
        return any(self.ignored("/".join(parts[:i]), True) for i in range(1, len(parts))) or self.ignored(rel, False)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether a path (relative to the root) is left out."""
        verdict = False
        for rule in self.rules:
            if rule.dir_only and not is_dir:
                continue
            if rule.base:
                if not rel.startswith(rule.base + "/"):
                    continue
                candidate = rel[len(rule.base) + 1:]
            else:
                candidate = rel
            if rule.pattern.match(candidate):
                verdict = not rule.negate
        return verdict


def scan(folder: str, excludes: Iterable[str] = ()) -> Scan:
    """The files of folder that sync (FileNotFoundError/NotADirectoryError for a bad folder)."""
    root = os.path.realpath(folder)
    if not os.path.isdir(root):
        raise NotADirectoryError(f"{folder} is not a folder")
    rules = IgnoreRules([*ALWAYS_EXCLUDED, *excludes])
    found = Scan(root, {}, rules=rules)
    seen_dirs = {root}
    stack = [("", root)]
    while stack:
        rel_dir, real_dir = stack.pop()
        if os.path.isfile(os.path.join(real_dir, ".gitignore")):
            rules.add_gitignore(rel_dir, os.path.join(real_dir, ".gitignore"))
        try:
            entries = list(os.scandir(real_dir))
        except OSError:
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            path = entry.path
            try:
                if entry.is_symlink():
                    target = os.path.realpath(path)
                    if target != root and not target.startswith(root + os.sep):
                        found.skipped_links.append(rel)
                        continue
                    info = os.stat(path)
                    path = target
                else:
                    info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                if rules.ignored(rel, True):
                    continue
                if path in seen_dirs:  # a symlink back to a folder already walked: a loop
                    found.skipped_links.append(rel)
                    continue
                seen_dirs.add(path)
                stack.append((rel, path))
            elif stat.S_ISREG(info.st_mode) and not rules.ignored(rel, False):
                found.files[rel] = LocalFile(path, info.st_size, info.st_mtime_ns, stat.S_IMODE(info.st_mode))
    return found


def local_sha256(path: str) -> str:
    """A local file's sha256 ("" if it cannot be read)."""
    try:
        return file_sha256(path)
    except OSError:
        return ""


# ---------------------------------------------------------------- one host


@dataclass
class HostResult:
    """What a sync did on one host."""

    host: str
    root: str = ""
    sent_files: int = 0
    sent_bytes: int = 0
    deleted: int = 0
    unchanged: int = 0
    errors: list[str] = field(default_factory=list)
    state: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # what the copy now holds
    shared_with: str = ""  # another host of the mesh whose copy this host sees (a shared disk)


Piece = tuple[str, int, int]  # (relative path, offset, length): part of a file for one write


def plan_writes(found: Scan, sends: list[str]) -> list[list[Piece]]:
    """The writes that carry `sends`: small files share one (up to CHUNK bytes, BATCH_FILES files),
    a large file goes in CHUNK-sized pieces."""
    writes: list[list[Piece]] = []
    batch: list[Piece] = []
    batch_bytes = 0
    for rel in sends:
        size = found.files[rel].size
        if size >= CHUNK:
            writes += [[(rel, at, min(CHUNK, size - at))] for at in range(0, size, CHUNK)]
            continue
        if batch and (batch_bytes + size > CHUNK or len(batch) >= BATCH_FILES):
            writes.append(batch)
            batch, batch_bytes = [], 0
        batch.append((rel, 0, size))
        batch_bytes += size
    if batch:
        writes.append(batch)
    return writes


def read_pieces(found: Scan, pieces: list[Piece]) -> tuple[list[tuple[str, int, int, int, int, Any]],
                                                            list[tuple[str, str]]]:
    """The pieces as write records (rel, mode, mtime_ns, offset, size, data), and the files that could not be read.

    Large data travels out of band (no copy into the frame); small files ride in it.
    """
    chunks, problems = [], []
    for rel, offset, length in pieces:
        local = found.files[rel]
        try:
            with open(local.path, "rb") as f:
                now = os.fstat(f.fileno())
                f.seek(offset)
                data = f.read(length)
        except OSError as exc:
            problems.append((rel, f"cannot read it here: {exc.strerror or exc}"))
            continue
        if len(data) != length or now.st_size != local.size or now.st_mtime_ns != local.mtime_ns:
            problems.append((rel, "changed while syncing (it was written to meanwhile); sync again"))
            continue
        chunks.append((rel, local.mode, local.mtime_ns, offset, local.size,
                       pickle.PickleBuffer(data) if length >= OUT_OF_BAND else data))
    return chunks, problems


async def sync_hosts(ops: HostOps, links: list[HostLink], key: str, found: Scan,
                     progress: dict[str, Progress]) -> list[HostResult | BaseException]:
    """Every host's copy level with `found`, all at once; hosts that share a disk are written once.

    Each host first lists its copy, which also says which disk the copy is on (`fsid`):
    on a cluster whose home folders are one NFS share, one host writes and the rest read.
    """
    listings = await asyncio.gather(*(ops.send(link, ListFiles(key)) for link in links),
                                    return_exceptions=True)
    writer: dict[str, HostLink] = {}
    listed: dict[str, WorkspaceListing] = {}
    for link, listing in zip(links, listings):
        if isinstance(listing, WorkspaceListing):
            writer.setdefault(listing.fsid, link)
            listed[link.name] = listing
    writers = list(writer.values())
    written = await asyncio.gather(*(sync_host(ops, link, key, found, progress[link.name], listed[link.name])
                                     for link in writers), return_exceptions=True)
    by_writer = dict(zip((link.name for link in writers), written))
    results: list[HostResult | BaseException] = []
    for link, listing in zip(links, listings):
        if isinstance(listing, BaseException):
            results.append(listing)
            continue
        leader = writer[listing.fsid]
        outcome = by_writer[leader.name]
        if leader is link or isinstance(outcome, BaseException):
            results.append(outcome)
        else:
            results.append(HostResult(link.name, root=listing.root, unchanged=len(found.files),
                                      state=outcome.state, shared_with=leader.name))
    return results


async def sync_host(ops: HostOps, link: HostLink, key: str, found: Scan, progress: Progress,
                    listing: WorkspaceListing) -> HostResult:
    """Bring one host's copy of workspace `key` (as `listing` shows it) level with `found`."""
    result = HostResult(link.name)
    result.root = listing.root
    remote = listing.files
    sends, maybe_same = [], []
    for rel, local in found.files.items():
        there = remote.get(rel)
        if there is None or there[0] != local.size or there[2] != local.mode:
            sends.append(rel)
        elif there[1] != local.mtime_ns:
            maybe_same.append(rel)
        else:
            result.unchanged += 1
    touches: dict[str, int] = {}
    if maybe_same:  # same size, another mtime: compare contents before sending
        theirs = (await ops.send(link, HashFiles(key, maybe_same))).hashes
        ours = await asyncio.to_thread(lambda: {rel: local_sha256(found.files[rel].path) for rel in maybe_same})
        for rel in maybe_same:
            if ours[rel] and ours[rel] == theirs.get(rel):
                touches[rel] = found.files[rel].mtime_ns
                result.unchanged += 1
            else:
                sends.append(rel)
    # what the folder leaves out (caches, data, .gitignore'd files) is the host's own: never deleted
    deletes = sorted(rel for rel in set(remote) - set(found.files)
                     if found.rules is None or not found.rules.ignored_path(rel))
    progress.files_total = len(sends)
    progress.bytes_total = sum(found.files[rel].size for rel in sends)
    failed: set[str] = set()
    in_flight: list[asyncio.Future[Any]] = []

    async def settle(limit: int) -> None:
        while len(in_flight) > limit:
            done = await in_flight.pop(0)
            for line in done.errors:  # one line per file (its later chunks fail the same way)
                rel = line.split(":", 1)[0]
                if rel not in failed:
                    failed.add(rel)
                    result.errors.append(line)

    for pieces in plan_writes(found, sends):
        pieces = [piece for piece in pieces if piece[0] not in failed]  # the rest of a file that failed: skip
        chunks, problems = await asyncio.to_thread(read_pieces, found, pieces)
        for rel, why in problems:
            if rel not in failed:
                failed.add(rel)
                result.errors.append(f"{rel}: {why}")
        progress.bytes_done += sum(len(memoryview(c[5])) for c in chunks)
        progress.files_done += sum(1 for c in chunks if c[3] + len(memoryview(c[5])) >= c[4])
        if chunks:
            in_flight.append(ops.send(link, WriteFiles(key, chunks, [], {})))
            await settle(WINDOW)
    if deletes or touches:
        in_flight.append(ops.send(link, WriteFiles(key, [], deletes, touches)))
    await settle(0)
    result.sent_files = len(sends) - len(failed & set(sends))
    result.sent_bytes = progress.bytes_done
    result.deleted = len(deletes)
    result.state = {rel: s for rel, s in found.quick_state().items() if rel not in failed}
    return result
