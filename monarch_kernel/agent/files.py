"""The agent's side of `Mesh.put` and `Mesh.get`: files in and out of a host, a chunk at a time.

A put lands in `PATH.monarch-partial-HOSTNAME` (hosts that share a disk never write the
same file; private until complete, never written through a link: core/partial_files.py)
and is renamed into place only once the whole
file's sha256 matches what the notebook sent, so a reader never sees half a file and an
interrupted put resumes from what the partial file already holds. A get reads chunks at
offsets the notebook asks for. Paths are the user's own (absolute, or `~` for the home
folder of the host's user): the agent runs as that user and may touch what it may.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
from typing import Any

from monarch_kernel.core.partial_files import finish_partial, open_partial, resumable_size
from monarch_kernel.core.workspace import file_sha256, prefix_digest, safe_relative
from monarch_kernel.wire import ops

PARTIAL = ".monarch-partial"
# puts in progress: destination -> (bytes hashed so far, sha256 of them), so that the end
# needs no second read of the file (chunks arrive in order; anything else falls back to one)
_hashing: dict[str, tuple[int, Any]] = {}


def _partial(dest: str) -> str:
    """Where a put to dest lands first: named per host, so hosts that share a disk never write one file."""
    return f"{dest}{PARTIAL}-{socket.gethostname()}"


def _path(path: str) -> str:
    full = os.path.expanduser(path)
    if not os.path.isabs(full):
        raise ValueError(f"{path!r} is not an absolute path (or ~/...)")
    return os.path.normpath(full)


def prefix_sha256(path: str, length: int) -> str:
    """sha256 of a file's first `length` bytes ("" if it is shorter or unreadable)."""
    digest = prefix_digest(path, length)
    return digest.hexdigest() if digest is not None else ""


def put_begin(path: str, size: int) -> ops.PutStarted:
    """What an earlier, interrupted put left: the partial file's length and its sha256 (0, "" if none)."""
    dest = _path(path)
    os.makedirs(os.path.dirname(dest) or "/", exist_ok=True)
    partial = _partial(dest)
    have = resumable_size(partial)  # (only a regular file of ours: never a planted link)
    if not 0 < have <= size:
        return ops.PutStarted(0, "", dest)
    digest = prefix_digest(partial, have)
    if digest is None:
        return ops.PutStarted(0, "", dest)
    _hashing[dest] = (have, digest.copy())
    return ops.PutStarted(have, digest.hexdigest(), dest)


def put_chunk(path: str, offset: int, data: Any) -> ops.ChunkWritten:
    """Write a chunk of the partial file at offset (private, and never through a link)."""
    dest = _path(path)
    fd = open_partial(_partial(dest), resume=offset > 0)
    with os.fdopen(fd, "r+b") as f:
        f.seek(offset)
        f.write(data)
    end = offset + len(memoryview(data))
    hashed = (0, hashlib.sha256()) if offset == 0 else _hashing.get(dest)
    if hashed is not None and hashed[0] == offset:
        hashed[1].update(data)
        _hashing[dest] = (end, hashed[1])
    else:
        _hashing.pop(dest, None)  # out of order: put_end reads the file back instead
    return ops.ChunkWritten(end)


def put_end(path: str, size: int, sha256: str, mode: int, mtime_ns: int) -> ops.PutFinished:
    """Check the whole file's sha256 and put it in place (the partial stays if it does not match)."""
    dest = _path(path)
    partial = _partial(dest)
    fd = open_partial(partial, resume=True)
    with os.fdopen(fd, "r+b") as f:
        f.truncate(size)
        hashed = _hashing.pop(dest, None)
        got = hashed[1].hexdigest() if hashed is not None and hashed[0] == size else file_sha256(f"/proc/self/fd/{fd}")
        if got != sha256:
            os.unlink(partial)
            raise OSError(f"{dest}: checksum mismatch after writing (sha256 {got[:12]}..., expected {sha256[:12]}...)")
        finish_partial(fd, partial, dest, mode, mtime_ns)
    return ops.PutFinished(dest)


def describe(path: str) -> ops.PathListing:
    """What a get will fetch: one file (size) or a folder's files (relative path -> size), with modes."""
    src = _path(path)
    info = os.stat(src)
    if stat.S_ISDIR(info.st_mode):
        files, modes = {}, {}
        for folder, _dirs, names in os.walk(src):
            for name in names:
                full = os.path.join(folder, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    rel = safe_relative(os.path.relpath(full, src).replace(os.sep, "/"))
                    found = os.stat(full)
                    files[rel], modes[rel] = found.st_size, stat.S_IMODE(found.st_mode)
        return ops.PathListing(src, True, files, modes)
    return ops.PathListing(src, False, {"": info.st_size}, {"": stat.S_IMODE(info.st_mode)})


def read_chunk(path: str, offset: int, size: int) -> ops.ChunkRead:
    """Bytes of a file from offset (fewer at its end)."""
    import pickle

    with open(_path(path), "rb") as f:
        f.seek(offset)
        data = f.read(size)
    return ops.ChunkRead(pickle.PickleBuffer(data))


def checksum(path: str) -> ops.FileChecksum:
    """A file's sha256 and size."""
    src = _path(path)
    return ops.FileChecksum(file_sha256(src), os.path.getsize(src))


def prefix(path: str, length: int) -> ops.PrefixChecksum:
    """The sha256 of a file's first `length` bytes ("" if it is shorter or unreadable)."""
    return ops.PrefixChecksum(prefix_sha256(_path(path), length))
