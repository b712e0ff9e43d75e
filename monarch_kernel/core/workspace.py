"""Where a synced workspace lives on a host, and which relative paths may be written there.

Shared by the notebook (which names a workspace), the host agent (which writes it) and
the ranks (which import from it): a workspace is named by a key made from the folder's
name and its absolute path on the notebook's machine, and lives under
`$MONARCH_KERNEL_WORKSPACE_ROOT` (default `~/.cache/monarch_kernel/workspaces`) on each host.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
from typing import Any

ROOT_ENV = "MONARCH_KERNEL_WORKSPACE_ROOT"
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,80}-[0-9a-f]{12}")


class UnsafePath(ValueError):
    """A relative path that would leave its workspace (absolute, `..`, empty parts)."""


def workspace_key(local_folder: str) -> str:
    """`NAME-HASH` for a folder on the notebook's machine (the same folder always gets the same key)."""
    folder = os.path.realpath(local_folder)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(folder) or "root")[:60].lstrip(".") or "root"
    return f"{name}-{hashlib.sha256(folder.encode()).hexdigest()[:12]}"


def workspaces_root() -> str:
    """The folder that holds this host's workspace copies."""
    return os.environ.get(ROOT_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "monarch_kernel", "workspaces")


def host_path(key: str) -> str:
    """The copy of workspace `key` on this host."""
    if not _KEY.fullmatch(key) or key.startswith("."):
        raise UnsafePath(f"{key!r} is not a workspace key")
    return os.path.join(workspaces_root(), key)


def _refuse(path: str, why: str) -> PermissionError:
    return PermissionError(f"workspace folder {path} {why}: another user could plant code the ranks would import "
                           f"there. Remove it, or set {ROOT_ENV} to a folder of your own")


def check_root(root: str) -> None:
    """The workspaces root may be shared (a team scratch folder) only if it is sticky, as /tmp is:
    otherwise another user could move our copies away and put theirs in their place."""
    info = os.stat(root)
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not info.st_mode & stat.S_ISVTX:
        raise _refuse(root, f"is writable by others (mode {stat.S_IMODE(info.st_mode):o}) and not sticky")
    if info.st_uid != os.getuid() and not info.st_mode & stat.S_ISVTX:
        raise _refuse(root, f"belongs to uid {info.st_uid}")


def check_private(folder: str) -> None:
    """A workspace copy must be a real folder (not a link) of ours that nobody else may enter."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(folder, "is not a folder (a link?)")
    if info.st_uid != os.getuid():
        raise _refuse(folder, f"belongs to uid {info.st_uid}")
    if info.st_mode & 0o077:
        raise _refuse(folder, f"is open to others (mode {stat.S_IMODE(info.st_mode):o})")


def private_host_path(key: str, *, create: bool) -> str:
    """host_path(key), checked to be ours alone (and made so if `create` and missing).

    A copy another user made first (a shared root), or could write, is refused: the ranks
    put the copy first on sys.path and would import what was planted there (a `.pyc` too).
    """
    root = workspaces_root()
    path = host_path(key)
    if create:
        os.makedirs(root, mode=0o700, exist_ok=True)
    check_root(root)
    if create:
        try:
            os.mkdir(path, 0o700)  # a plain mkdir: an existing folder is checked, never adopted blindly
        except FileExistsError:
            pass
    check_private(path)
    return path


def file_sha256(path: str) -> str:
    """A file's sha256, read in 1 MiB pieces (raises OSError)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def prefix_digest(path: str, length: int) -> Any:
    """A sha256 object fed with a file's first `length` bytes (None if the file is shorter or unreadable)."""
    digest = hashlib.sha256()
    left = length
    try:
        with open(path, "rb") as f:
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    return None
                digest.update(chunk)
                left -= len(chunk)
    except OSError:
        return None
    return digest


def safe_relative(path: str) -> str:
    """A '/'-separated relative path, checked to stay inside its folder (raises UnsafePath)."""
    if not path or "\0" in path or path.startswith("/") or "\\" in path:
        raise UnsafePath(f"{path!r} is not a relative path")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise UnsafePath(f"{path!r} has empty, '.' or '..' parts")
    return posixpath.join(*parts)
