"""The agent's side of workspace sync: list, hash, write and delete files of a host's workspace copy.

The controller decides what changed; the agent only answers listings and applies writes,
one operation at a time (the agent runs them in order on one thread). Every relative path
is checked (`core.workspace.safe_relative`) and every write lands inside the workspace's
folder, through a temporary file renamed into place, with the sender's mode and mtime (so
the next sync's quick check by size and mtime finds it unchanged). Per-file failures
(a full disk, a permission) are returned, not raised: the other files still land.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from typing import Any

from monarch_kernel.core.partial_files import finish_partial, open_partial
from monarch_kernel.core.workspace import (
    check_private,
    file_sha256,
    host_path,
    private_host_path,
    safe_relative,
    workspaces_root,
)
from monarch_kernel.wire import ops

PARTIAL = ".monarch-partial"  # a file still arriving


def list_files(key: str) -> ops.WorkspaceListing:
    """Every file of the copy: relative path -> (size, mtime_ns, mode)."""
    root = host_path(key)
    if os.path.lexists(root):
        check_private(root)
    files: dict[str, tuple[int, int, int]] = {}
    stack = [("", root)]
    while stack:
        prefix, folder = stack.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((prefix + entry.name + "/", entry.path))
                    elif entry.is_file(follow_symlinks=False) and not entry.name.endswith(PARTIAL):
                        info = entry.stat(follow_symlinks=False)
                        files[prefix + entry.name] = (info.st_size, info.st_mtime_ns, stat.S_IMODE(info.st_mode))
                except OSError:
                    continue
    return ops.WorkspaceListing(root, files, filesystem_id())


def filesystem_id() -> str:
    """A random id kept in the workspaces folder: hosts that read the same one share that disk (NFS homes)."""
    folder = workspaces_root()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    marker = os.path.join(folder, f".monarch-fsid-{os.getuid()}")
    if not os.path.lexists(marker):
        # written whole under a name of its own, then linked into place: a host that shares this
        # disk and looks at the same moment never reads a marker that is still empty
        temp = os.path.join(folder, f".monarch-fsid-{os.getuid()}-{uuid.uuid4().hex}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex)
        try:
            os.link(temp, marker)
        except FileExistsError:
            pass  # another host won the race: its marker is the one
        finally:
            os.unlink(temp)
    return _read_marker(marker)


def _read_marker(marker: str) -> str:
    """The id in a marker of ours; a fresh one (this disk shares with nobody) if it is not ours:
    a marker another user planted would make our hosts skip each other's copies."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return uuid.uuid4().hex
    with os.fdopen(fd, encoding="ascii", errors="replace") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return uuid.uuid4().hex
        return f.read().strip()


def hash_files(key: str, paths: list[str]) -> ops.WorkspaceHashes:
    """sha256 of each named file of the copy ("" if it cannot be read)."""
    root = host_path(key)
    out = {}
    for rel in paths:
        try:
            out[rel] = file_sha256(os.path.join(root, safe_relative(rel)))
        except OSError:
            out[rel] = ""
    return ops.WorkspaceHashes(out)


def _inside(root: str, path: str) -> str:
    """path, after checking that its folder resolves inside root (no symlinked parent leads out)."""
    folder = os.path.realpath(os.path.dirname(path))
    real_root = os.path.realpath(root)
    if folder != real_root and not folder.startswith(real_root + os.sep):
        raise PermissionError(errno.EACCES, f"{path} would be written outside the workspace")
    return path


def write_files(key: str, files: list[tuple[str, int, int, int, int, Any]], deletes: list[str],
                touches: dict[str, int] | None = None) -> ops.WorkspaceWritten:
    """Apply chunks (rel, mode, mtime_ns, offset, total size, data), deletions and mtime fixes."""
    root = private_host_path(key, create=True)  # ours alone, or refused (PermissionError, to the notebook)
    errors: list[str] = []
    written = done_bytes = 0
    for rel, mode, mtime_ns, offset, total, data in files:
        try:
            dest = _inside(root, os.path.join(root, safe_relative(rel)))
            _make_parent(root, dest)
            partial = dest + PARTIAL
            with os.fdopen(open_partial(partial, resume=offset > 0), "r+b") as f:  # (never through a link)
                f.seek(offset)
                f.write(data)
                end = offset + len(memoryview(data))
                if end >= total:
                    f.truncate(total)
                    f.flush()
                    if os.path.isdir(dest) and not os.path.islink(dest):
                        shutil.rmtree(dest)  # a folder became a file
                    finish_partial(f.fileno(), partial, dest, mode, mtime_ns)
                    written += 1
            done_bytes += len(memoryview(data))
        except OSError as exc:
            errors.append(f"{rel}: {exc.strerror or exc}")
            _discard(root, rel)  # a full disk: free what this file took, so that the other files still land
        except ValueError as exc:
            errors.append(f"{rel}: {exc}")
    for rel in deletes:
        try:
            path = _inside(root, os.path.join(root, safe_relative(rel)))
            os.unlink(path)
            _prune_empty(root, os.path.dirname(path))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            errors.append(f"{rel}: cannot delete: {getattr(exc, 'strerror', None) or exc}")
    for rel, mtime_ns in (touches or {}).items():
        try:
            os.utime(_inside(root, os.path.join(root, safe_relative(rel))), ns=(mtime_ns, mtime_ns))
        except (OSError, ValueError) as exc:
            errors.append(f"{rel}: {getattr(exc, 'strerror', None) or exc}")
    return ops.WorkspaceWritten(root, written, done_bytes, len(deletes), errors)


def _discard(root: str, rel: str) -> None:
    try:
        os.unlink(os.path.join(root, safe_relative(rel)) + PARTIAL)
    except (OSError, ValueError):
        pass


def _make_parent(root: str, dest: str) -> None:
    parent = os.path.dirname(dest)
    if os.path.isfile(parent) or os.path.islink(parent):  # a file became a folder
        os.unlink(parent)
    os.makedirs(parent, exist_ok=True)
    _inside(root, dest)


def _prune_empty(root: str, folder: str) -> None:
    """Remove folders a deletion left empty, up to the workspace root."""
    root = os.path.realpath(root)
    folder = os.path.realpath(folder)
    while folder.startswith(root + os.sep):
        try:
            os.rmdir(folder)
        except OSError:
            return
        folder = os.path.dirname(folder)
