"""The key that admits a client to this user's workers over TCP (`attach_to_workers`).

`$XDG_STATE_HOME/monarch_kernel/worker.key` (`~/.local/state/...` without it): 32 random bytes, hex,
mode 0600 in a 0700 folder of the user's, made by whichever of the worker or the client needs it
first. Both ends prove it to each other over fresh X25519 keys and never send it
(`wire/direct_auth.py`), so a worker on a TCP port takes work only from its user's clients, over an
encrypted link. Workers on other machines need the same file (a shared home has it; else copy it,
privately). A key file that is not a private plain file of ours is refused, never followed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import tempfile

from monarch_kernel.core.mesh_records import records_folder

KEY_BYTES = 32


class WorkerKeyError(RuntimeError):
    """The key file is unsafe or unreadable (the message says what to do)."""


def worker_key_path() -> str:
    """Where the key is."""
    return os.path.join(os.path.dirname(records_folder()), "worker.key")


def worker_key() -> bytes:
    """The user's worker key, made now if there is none."""
    path = worker_key_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    folder = os.lstat(os.path.dirname(path))
    if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.getuid() or folder.st_mode & 0o077:
        raise WorkerKeyError(f"{os.path.dirname(path)} must be a folder of yours that only you can read (mode 0700, "
                             "not a link)")
    if not os.path.lexists(path):  # written aside, then linked in whole: a reader never sees half a key
        fd, temp = tempfile.mkstemp(prefix=".worker-", suffix=".key", dir=os.path.dirname(path))  # 0600
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(os.urandom(KEY_BYTES).hex())
            os.link(temp, path)
        except FileExistsError:
            pass  # another process made it first: theirs is the key
        finally:
            os.unlink(temp)
    return _read(path)


def _read(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkerKeyError(f"the worker key {path} cannot be opened safely ({exc}); remove it to make a new one") \
            from None
    with os.fdopen(fd, "r", encoding="ascii") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise WorkerKeyError(f"the worker key {path} is not a private file of yours (mode 0600): refusing it")
        text = f.read(4 * KEY_BYTES).strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise WorkerKeyError(f"the worker key {path} is not {KEY_BYTES} bytes in hex (a write was cut?): remove it "
                             "on every host and start the workers again")
    return key


# What a client asks of a worker, in the one byte it sends first: the key each is proved with is the worker key
# bound to it, so that nobody between them can turn one into the other.
START_AGENT = b"A"  # start a host agent for this connection (a mesh on the worker's host)
END_WORKER = b"X"  # end the worker (HostMesh.shutdown of attach_to_workers' hosts)


def request_key(key: bytes, request: bytes) -> bytes:
    """The worker key bound to one request."""
    return hmac.new(key, b"monarch-kernel worker request " + request, hashlib.sha256).digest()
