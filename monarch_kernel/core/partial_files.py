"""Files written in place under a predictable name (`DEST.monarch-partial...`), safely.

Put, get and workspace sync write a file under a partial name first and rename it into place
once its checksum matches, so that an interrupted transfer can resume. In a folder other users
may write (a team's `/project`, a scratch folder that is not sticky), such a name is a target:
a symlink planted there would make us overwrite, re-mode and finally move into place a file of
the planter's choosing. So a partial file is only ever opened without following links, must be
a regular file of ours, is private (0600) until it is complete, and gets its mode and times
through its descriptor; it is renamed into place only if the name still means the file we wrote.
"""

from __future__ import annotations

import os
import stat

PRIVATE = 0o600


def _ours(fd: int, path: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a regular file of this user: refusing to write through it")
    return info


def open_partial(path: str, *, resume: bool) -> int:
    """A descriptor open for writing on the partial file at `path` (never through a link).

    resume: keep what an earlier transfer wrote (the file must be a regular file of ours);
    otherwise whatever is there (a file, a planted link) is removed and a new private file made.
    """
    if resume:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _ours(fd, path)
            os.fchmod(fd, PRIVATE)
        except BaseException:
            os.close(fd)
            raise
        return fd
    try:
        os.unlink(path)  # (unlink removes a link itself, never its target)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE)


def resumable_size(path: str) -> int:
    """How many bytes an earlier transfer left in a partial file of ours (0 if none, or not ours)."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return 0
    return info.st_size


def finish_partial(fd: int, partial: str, dest: str, mode: int, mtime_ns: int | None = None) -> None:
    """Give the complete file its mode (and times) through its descriptor, then rename it to dest,
    if `partial` still names that very file (raises PermissionError if it was swapped)."""
    info = _ours(fd, partial)
    os.fchmod(fd, mode & 0o7777)
    if mtime_ns is not None:
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    now = os.lstat(partial)
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
        raise PermissionError(f"{partial} was replaced while it was written: refusing to move it into place")
    os.replace(partial, dest)  # (a link planted at dest is replaced, not written through)
