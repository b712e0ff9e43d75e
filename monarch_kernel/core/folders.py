"""A process's private folders: made 0700 under /dev/shm (or the temp folder), marked as owned by a
live process, and swept once their owner is gone (a killed process cleans up nothing).

Kernels keep a mesh's sockets and shared-memory buffers in such folders; host agents keep the
buffers of a push they hand to several ranks of their host.

Liveness is a lock, not a pid: the owner holds a shared `flock` on the folder's `.owner` file for
its whole life (the kernel frees it when the process ends, however it ends), and a sweep, which
takes it exclusively, cannot while anyone holds it. Another process may hold the folder too
(`share_folder`: the agent of a mesh that outlives its kernel). A pid would mean nothing
to a process in another PID namespace that shares /dev/shm (containers run with `--ipc=host`),
which would take a live mesh's folders for stale ones.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

OWNER_FILE = ".owner"  # locked by the owner for its life; holds its pid, for people reading it
_held: dict[str, int] = {}  # folder -> the descriptor whose lock says "its owner is alive"


def owned_folder(path: str, *, remove_on_failure: bool = True) -> str:
    """Mark a folder as this process's, for as long as it lives (or until `release_folder`).

    The owner file is locked before it takes its name, so no sweep ever sees it unlocked.
    If marking fails (a full /dev/shm), the folder is removed (unless told not to) and the
    error raised.
    """
    try:
        fd, temp = tempfile.mkstemp(prefix=".owner-", dir=path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            os.write(fd, str(os.getpid()).encode())
            os.rename(temp, os.path.join(path, OWNER_FILE))
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        if remove_on_failure:
            shutil.rmtree(path, ignore_errors=True)  # half-made: nothing could ever tell it is stale
        raise
    _held[path] = fd
    return path


def share_folder(path: str, timeout: float = 2.0) -> None:
    """Hold another process's marked folder alive too, for as long as this process lives (or until
    `release_folder`): raises OSError if it is not a folder of ours that still has an owner."""
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise PermissionError(f"{path} is not a folder of ours")
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # a sweep looks at it this instant
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    except BaseException:
        os.close(fd)
        raise
    old = _held.pop(path, None)
    if old is not None:
        os.close(old)
    _held[path] = fd


def forget_folder(path: str) -> None:
    """Let go of our hold on a folder without removing it (another process holds it too)."""
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def release_folder(path: str) -> None:
    """Remove a folder of ours and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def owner_is_alive(path: str) -> bool | None:
    """Whether the owner of a marked folder still lives (None: not a marked folder of ours)."""
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # not a folder of ours, or one that is being made
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        return False
    finally:
        os.close(fd)  # (closing drops a lock we took)


def remove_if_orphaned(path: str) -> bool:
    """Remove a marked folder whose owner is gone; whether it was removed."""
    if path in _held or owner_is_alive(path) is not False:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def sweep_stale_folders() -> list[str]:
    """Remove mesh folders of this user whose owner is gone (it was killed: no cleanup ran).

    Only folders named `monarch-*`, owned by this user, with an owner file nobody holds
    locked are removed; they hold sockets and shared-memory buffers.
    """
    removed = []
    for base in {"/dev/shm", tempfile.gettempdir()}:
        try:
            names = [n for n in os.listdir(base) if n.startswith("monarch-")]
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            try:
                if os.lstat(path).st_uid != os.getuid():
                    continue
            except OSError:
                continue
            if remove_if_orphaned(path):
                removed.append(path)
    return removed


def private_shm_dir(name: str) -> str:
    """A new 0700 folder `monarch-NAME-*` in /dev/shm (the temp folder where there is none)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix=f"monarch-{name}-", dir=base)
    os.chmod(path, 0o700)
    return path
