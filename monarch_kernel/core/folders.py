"""A process's private folders: made 0700 under /dev/shm (or the temp folder), marked with the
owner's pid, and swept once their owner is gone (a killed process cleans up nothing).

Kernels keep a mesh's sockets and shared-memory buffers in such folders; host agents keep the
buffers of a push they hand to several ranks of their host.
"""

from __future__ import annotations

import os
import shutil
import tempfile

OWNER_FILE = ".owner"  # the pid of the kernel a mesh folder belongs to


def owned_folder(path: str) -> str:
    """Mark a folder with this process's pid, so a later process can tell when it is stale."""
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def sweep_stale_folders() -> list[str]:
    """Remove mesh folders of this user whose kernel is gone (it was killed: no cleanup ran).

    Only folders named `monarch-*`, owned by this user and marked with the pid of a
    process that no longer exists are removed; they hold sockets and shared-memory buffers.
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
                with open(os.path.join(path, OWNER_FILE)) as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue  # not a folder of ours, or one from before owners were written
            if not _pid_exists(pid):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def private_shm_dir(name: str) -> str:
    """A new 0700 folder `monarch-NAME-*` in /dev/shm (the temp folder where there is none)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix=f"monarch-{name}-", dir=base)
    os.chmod(path, 0o700)
    return path
