"""Shared-memory buffers between the processes of one host: the files of a private folder that
carry a value's large buffers, recycled between sends, and the mappings kept of them.

Buffers are written into *recycled* files when one is free: fresh tmpfs pages cost more
than the copy itself (each is allocated and zeroed), so once the receivers' objects are gone
the file is renamed `free-*` and the next buffer of its size class reuses its pages. One
receiver (a pull, a result, an actor's reply) renames it when its mapping goes. Several (a
push) each hold a hard link (`hold-*`) while they map it, as the sender does until every
receiver has answered; whoever drops the last link renames it. The folder is the only
channel: no message goes back to the writer, and the pool is bounded (`SHM_POOL_BYTES`).
A buffer for one receiver is *its* file until it lets go, so both ends map recycled files
shared and keep those mappings (`_MAPPINGS`): the next buffer in the same file is a memcpy
into pages the writer already maps and a view of pages the receiver already maps, with no
page faults at either end. `serialization.py` decides which buffers come here.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.wire.mmaps import libc_or_none, map_private

SHM_THRESHOLD = 1 << 20  # buffers from 1 MiB go through shared memory on one host
SHM_POOL_BYTES = int(os.environ.get("MONARCH_KERNEL_SHM_POOL_BYTES", 1 << 30))  # free files kept per mesh folder


@dataclass(frozen=True)
class ShmRef:
    """A buffer that was written to a file under a private shared-memory folder."""

    path: str
    nbytes: int
    unlink_on_open: bool
    recycle: bool = False  # renamed free-* once the receivers' objects are gone (see the module's note)
    held: bool = False  # several receivers: each holds a hard link while it maps the file


def to_shm(buf: memoryview, shm_dir: str, shared: bool) -> ShmRef | memoryview:
    """Write a buffer to a private shared-memory file; the buffer itself if that fails.

    /dev/shm may be full (Docker's default is 64 MB), or out of descriptors or over a file
    size limit: the bytes then travel in the frame, and no partial file is left behind.
    The buffer goes into a recycled file of its size class when one is free; a `shared` one
    (several receivers) is held by the sender's link until `release`.
    """
    nbytes = memoryview(buf).nbytes
    ref = _claim_free(shm_dir, nbytes, shared)
    if ref is not None:
        if not _write_mapped(ref.path, buf):  # (the receivers of a shared one map it privately: no conflict)
            return buf
    else:
        ref = ShmRef(os.path.join(shm_dir, "buf-" + secrets.token_hex(8)), nbytes, False, True, shared)
        if not _write_file(ref.path, buf, os.O_WRONLY | os.O_CREAT | os.O_EXCL):
            return buf
        try:  # sized to its class, so that it can be recycled for any buffer of that class
            os.truncate(ref.path, max(nbytes, _size_class(nbytes)))
        except OSError:
            pass
    return _held_by_sender(ref) if shared else ref


def _held_by_sender(ref: ShmRef) -> ShmRef:
    """A buffer for several receivers: the sender holds a link to it until every one answered (release)."""
    try:
        os.link(ref.path, hold_path(ref.path, "sender"))
    except OSError:
        return ShmRef(ref.path, ref.nbytes, unlink_on_open=False)  # the old way: release() unlinks it
    return ref


def fill_shm(shm_dir: str, nbytes: int, shared: bool, fill: Callable[[Any], None]) -> ShmRef | None:
    """A shared-memory file whose first nbytes `fill` writes through this process's kept mapping
    of it (a writable buffer of nbytes); None, and no file left, if no mapping can be had."""
    ref = _claim_free(shm_dir, nbytes, shared)
    if ref is None:
        ref = ShmRef(os.path.join(shm_dir, "buf-" + secrets.token_hex(8)), nbytes, False, True, shared)
        try:
            fd = os.open(ref.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None
        try:  # sized to its class, so that it can be recycled for any buffer of that class
            os.ftruncate(fd, _size_class(nbytes))
        except OSError:
            os.close(fd)
            unlink_quietly(ref.path)
            return None
    else:
        try:
            fd = os.open(ref.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
    try:
        mapping = _MAPPINGS.get(fd, shm_dir, nbytes, write=True)  # (pages allocated first: no SIGBUS)
        if mapping is None:
            unlink_quietly(ref.path)
            return None
        fill((ctypes.c_char * nbytes).from_address(mapping.addr))
    except BaseException:
        unlink_quietly(ref.path)
        raise
    finally:
        os.close(fd)
    return _held_by_sender(ref) if shared else ref


@dataclass
class _Mapping:
    """One kept mapping: where, how large, which mesh folder, how many receivers' objects view it."""

    addr: int
    size: int
    folder: str
    populated: int = 0  # how many leading bytes' pages are mapped in
    users: int = 0
    forgotten: bool = False  # its folder went (the mesh is down): unmap once nobody views it


class _Mappings:
    """This process's shared, writable mappings of recycled files, by inode (least recently used first).

    Raw mappings (no descriptor is kept open for them). One that a receiver's object views is
    never unmapped under it: eviction and `forget` skip it until its last view is gone.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.maps: dict[tuple[int, int], _Mapping] = {}

    def get(self, fd: int, folder: str, nbytes: int, write: bool) -> _Mapping | None:
        """The mapping of fd's file, made and kept if there is none, with its first nbytes' pages
        mapped in; None if there is no libc, or if those pages cannot be had without a SIGBUS risk
        (a writer then uses pwrite, which fails cleanly)."""
        libc = libc_or_none()
        if libc is None:
            return None
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        found = self.maps.pop(key, None)
        if found is not None and found.size != info.st_size:
            self._unmap(found)
            found = None
        if found is None:
            addr = libc.mmap(None, info.st_size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            found = _Mapping(addr, info.st_size, folder)
        self.maps[key] = found
        if nbytes > found.populated:  # once per file and size: its pages stay mapped after
            advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
            if libc.madvise(ctypes.c_void_p(found.addr), nbytes, advice) == 0:
                found.populated = nbytes
            elif write and info.st_blocks * 512 < nbytes:
                return None
        self._evict(keep=key)
        return found

    def view(self, mapping: _Mapping, nbytes: int, path: str) -> Any:
        """A receiver's buffer over the mapping; when it goes, the file is recycled."""
        mapping.users += 1
        array = (ctypes.c_char * nbytes).from_address(mapping.addr)
        weakref.finalize(array, self._let_go, mapping, path, nbytes)
        return array

    def _let_go(self, mapping: _Mapping, path: str, nbytes: int) -> None:
        mapping.users -= 1
        if mapping.forgotten and not mapping.users:
            self._unmap(mapping)
        recycle(path, nbytes)

    def forget(self, folder: str) -> None:
        """A mesh's folder is gone: unmap its files (each as soon as no object views it)."""
        for key, mapping in list(self.maps.items()):
            if mapping.folder == folder:
                del self.maps[key]
                mapping.forgotten = True
                if not mapping.users:
                    self._unmap(mapping)

    def _evict(self, keep: tuple[int, int]) -> None:
        total = sum(m.size for m in self.maps.values())
        for key, mapping in list(self.maps.items()):
            if total <= self.limit:
                return
            if key == keep or mapping.users:
                continue
            del self.maps[key]
            self._unmap(mapping)
            total -= mapping.size

    @staticmethod
    def _unmap(mapping: _Mapping) -> None:
        libc = libc_or_none()
        if libc is not None and mapping.addr:
            libc.munmap(ctypes.c_void_p(mapping.addr), mapping.size)
            mapping.addr = 0


_MAPPINGS = _Mappings(SHM_POOL_BYTES)
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+: fault pages in at once, or fail without SIGBUS


def forget_mappings(folder: str) -> None:
    """The mesh whose shared-memory folder this was is down: let its kept mappings go."""
    _MAPPINGS.forget(folder)


COPY_CHUNK = 16 << 20  # a copy into a mapping holds the GIL: this much at a time


def _write_mapped(path: str, buf: memoryview) -> bool:
    """Copy buf to the start of a recycled file through this process's kept mapping of it.

    A page that tmpfs would have to allocate through a mapping raises SIGBUS when /dev/shm is
    full, so the pages are allocated first by a call that fails instead (or were allocated by
    an earlier buffer); otherwise the bytes are written with pwrite, which also fails cleanly.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        view = memoryview(buf).cast("B")
        mapping = _MAPPINGS.get(fd, os.path.dirname(path), view.nbytes, write=True)
        if mapping is None:
            return _write_file(path, buf, os.O_WRONLY)
        target = memoryview((ctypes.c_char * view.nbytes).from_address(mapping.addr)).cast("B")
        for start in range(0, view.nbytes, COPY_CHUNK):  # (between chunks, other threads get the GIL)
            target[start:start + COPY_CHUNK] = view[start:start + COPY_CHUNK]
    except (OSError, ValueError):
        unlink_quietly(path)
        return False
    finally:
        os.close(fd)
    return True


def _write_file(path: str, buf: memoryview, flags: int) -> bool:
    """Write buf at the start of path; False (and the file removed) if that fails."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    try:
        view = memoryview(buf).cast("B")
        written = 0
        while written < view.nbytes:
            written += os.pwrite(fd, view[written:], written)
    except OSError:
        unlink_quietly(path)
        return False
    finally:
        os.close(fd)
    return True


def _size_class(nbytes: int) -> int:
    """The file size a recycled buffer of nbytes gets: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


_FREE_FILE = re.compile(r"free-(\d+)-[0-9a-f]{16}")


def _claim_free(shm_dir: str, nbytes: int, shared: bool) -> ShmRef | None:
    """Take a free file of nbytes' size class (renamed to a fresh buf-* name), trimming the pool; None if none."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return None
    wanted = _size_class(nbytes)
    free = [(int(m.group(1)), name) for name in names if (m := _FREE_FILE.fullmatch(name))]
    for size, name in free:
        if size != wanted:
            continue
        path = os.path.join(shm_dir, "buf-" + secrets.token_hex(8))
        try:
            os.rename(os.path.join(shm_dir, name), path)  # atomic: two writers never get the same file
        except OSError:
            continue  # another process of the mesh took it first
        return ShmRef(path, nbytes, unlink_on_open=False, recycle=True, held=shared)
    total = sum(size for size, _ in free)
    for size, name in sorted(free):  # over the bound: the smallest go first (the large ones cost most to remake)
        if total <= SHM_POOL_BYTES - wanted:
            break
        unlink_quietly(os.path.join(shm_dir, name))
        total -= size
    return None


def recycle(path: str, size: int, hold: str | None = None) -> None:
    """A receiver's object is gone: drop its hold link (if any); if nobody else holds the file,
    make it free for the next buffer of its class."""
    try:
        if hold is not None:
            os.unlink(hold)
            if os.stat(path).st_nlink > 1:
                return  # another receiver (or the sender) still holds it
        # two last holders may both get here: the second rename finds no file and does nothing
        os.rename(path, os.path.join(os.path.dirname(path), f"free-{_size_class(size)}-{secrets.token_hex(8)}"))
    except OSError:
        pass  # already recycled, or the mesh's folder is gone


def hold_path(path: str, who: str) -> str:
    """The hard link a holder of a shared buffer keeps: `hold-<buffer's hex>-<who>`."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"hold-{name.removeprefix('buf-')}-{who}")


def open_shm(ref: ShmRef) -> Any:
    """A view of a shared-memory buffer: for one receiver, its kept shared mapping of the file;
    for several, a private (copy-on-write) mapping: every receiver maps the one copy the sender
    wrote, and a page is only copied if that receiver writes to it.
    """
    _check_shm_path(ref)
    fd = os.open(ref.path, (os.O_RDWR if ref.recycle and not ref.held else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_size < ref.nbytes:
            raise ValueError(f"{ref.path} is not one of our buffers of {ref.nbytes} bytes")
        if ref.recycle and not ref.held:  # this receiver's own file until it lets go: a kept, shared mapping
            mapping = _MAPPINGS.get(fd, os.path.dirname(ref.path), ref.nbytes, write=False)
            if mapping is not None:
                return _MAPPINGS.view(mapping, ref.nbytes, ref.path)
        reuse = ref.recycle and libc_or_none() is not None  # (without libc, no hook runs after the unmap)
        hold = None
        if ref.held:  # (without the unmap hook the link stays, and the file is never reused under us)
            hold = hold_path(ref.path, f"{os.getpid()}-{secrets.token_hex(4)}")
            os.link(ref.path, hold)
        mapped = map_private(fd, ref.nbytes,
                             on_unmap=(lambda: recycle(ref.path, ref.nbytes, hold)) if reuse else None)
    finally:
        os.close(fd)
    if ref.unlink_on_open or (ref.recycle and not reuse and not ref.held):
        unlink_quietly(ref.path)
    return mapped


_SHM_FILE = re.compile(r"buf-[0-9a-f]{16}")


def _check_shm_path(ref: ShmRef) -> None:
    """A reference from a peer names one of our own buffers, or it is refused (never opened or removed).

    Ours: a `buf-<16 hex>` file in a `monarch-*` folder that we own and nobody else may
    enter (0700). Remote ranks never send references (their shm_dir is None), so a
    reference to anything else is a bug or an attack.
    """
    folder, name = os.path.split(ref.path)
    if not _SHM_FILE.fullmatch(name) or not os.path.basename(folder).startswith("monarch-") or ref.nbytes < 0:
        raise ValueError(f"{ref.path!r} is not a shared-memory buffer of a mesh")
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(f"{folder!r} is not a private folder of this user")


def unlink_quietly(path: str) -> None:
    """Remove a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
