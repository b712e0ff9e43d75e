"""Values on the wire: cloudpickle with pickle-5 out-of-band buffers.

`seal(obj)` turns a user value into a `Sealed` blob whose large buffers (tensor and
numpy data) stay out of band, so they are sent with scatter-gather writes and never
copied into the pickle stream. Between processes of one host, buffers over
`SHM_THRESHOLD` go through a file in a private shared-memory folder instead, which
the receiver maps copy-on-write: one memcpy in total for a push or a pull.

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
page faults at either end.

Hosts agents forward Sealed blobs without unpickling them.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import io
import mmap
import os
import pickle
import re
import secrets
import stat
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from monarch_kernel.core.errors import SerializationError

SHM_THRESHOLD = 1 << 20  # buffers from 1 MiB go through shared memory on one host
SHM_POOL_BYTES = int(os.environ.get("MONARCH_KERNEL_SHM_POOL_BYTES", 1 << 30))  # free files kept per mesh folder
_NONE_PICKLE = pickle.dumps(None, protocol=5)


@dataclass(frozen=True)
class ShmRef:
    """A buffer that was written to a file under a private shared-memory folder."""

    path: str
    nbytes: int
    unlink_on_open: bool
    recycle: bool = False  # renamed free-* once the receivers' objects are gone (see the module's note)
    held: bool = False  # several receivers: each holds a hard link while it maps the file


@dataclass
class Sealed:
    """A pickled value plus its out-of-band buffers (bytes-like objects or ShmRefs)."""

    data: bytes
    buffers: list[Any] = field(default_factory=list)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:  # the pickle hook
        if not self.buffers:
            return (Sealed, (self.data,))
        bufs = [b if isinstance(b, ShmRef) else pickle.PickleBuffer(b) for b in self.buffers]
        return (Sealed, (self.data, bufs))

    def parts(self) -> tuple[bytes, tuple[Any, ...]]:
        """(data, buffers) for a flat frame; bytes-like buffers travel out of band."""
        if not self.buffers:
            return (self.data, ())
        return (self.data, tuple(b if isinstance(b, ShmRef) else pickle.PickleBuffer(b) for b in self.buffers))

    @classmethod
    def from_parts(cls, parts: tuple[Any, ...]) -> Sealed:
        """The Sealed that parts() described."""
        return cls(parts[0], list(parts[1]))

    @property
    def nbytes(self) -> int:
        """Total payload size: pickle stream plus buffers."""
        total = len(self.data)
        for b in self.buffers:
            total += b.nbytes if isinstance(b, ShmRef) else memoryview(b).nbytes
        return total

    def shm_paths(self) -> list[str]:
        """Shared-memory files this blob refers to (for the sender to clean up)."""
        return [b.path for b in self.buffers if isinstance(b, ShmRef)]


def _torch_pickler_base() -> type:
    import cloudpickle

    base: type = cloudpickle.Pickler
    return base


class _Pickler(_torch_pickler_base()):  # type: ignore[misc]
    """cloudpickle, plus CPU/GPU tensors sent as raw out-of-band bytes.

    With `shm_dir`, a large tensor that must be copied anyway to become bytes (on a GPU, or
    not contiguous) is copied once, straight into a shared-memory file (see `_place`): its
    out-of-band slot then holds the file's ShmRef (`placed`), not a staging copy.
    """

    def __init__(self, out: io.BytesIO, *, shm_dir: str | None = None, shared: bool = False, **kwargs: Any):
        super().__init__(out, **kwargs)
        self.shm_dir, self.shared = shm_dir, shared
        self.placed: dict[int, tuple[pickle.PickleBuffer, ShmRef]] = {}  # id(slot) -> (slot, its file)

    def reducer_override(self, obj: Any) -> Any:
        """Code keeps its file name; plain CPU/GPU tensors travel as raw buffers."""
        if type(obj) is types.CodeType:
            # cloudpickle renames code to "<dynamic-code>"; keep the real file name so
            # remote tracebacks can show the notebook's lines (shipped to linecache)
            rebuild, args = self.dispatch_table[types.CodeType](obj)
            return rebuild, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = _reduce_tensor(torch, obj, self)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _place(self, torch: Any, data: Any) -> pickle.PickleBuffer | None:
        """Copy a tensor once into a shared-memory file (GPU memory to it directly); the
        out-of-band slot that stands for it, or None (no folder, too small, or no file could
        be had: the caller makes bytes the usual way)."""
        nbytes = data.numel() * data.element_size()
        if self.shm_dir is None or nbytes < SHM_THRESHOLD:
            return None

        def fill(into: Any) -> None:
            torch.frombuffer(into, dtype=torch.uint8).view(data.dtype).view(data.shape).copy_(data)

        ref = _fill_shm(self.shm_dir, nbytes, self.shared, fill)
        if ref is None:
            return None
        slot = pickle.PickleBuffer(bytearray())  # a unique stand-in: seal() puts the ShmRef in its place
        self.placed[id(slot)] = (slot, ref)
        return slot


def _reduce_tensor(torch: Any, t: Any, pickler: _Pickler) -> tuple[Any, ...] | None:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return None
    if t.requires_grad and not t.is_leaf:
        return None  # let torch raise its own clear error
    data = t.detach()
    slot = None
    if data.device.type != "cpu" or not data.is_contiguous():  # a copy is needed: make it the only one
        slot = pickler._place(torch, data)
    if slot is None:
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous()
        slot = pickle.PickleBuffer(data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b"")
    return (
        _rebuild_tensor,
        (slot, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.requires_grad, t.device.type),
    )


_arrival: contextvars.ContextVar[str | None] = contextvars.ContextVar("monarch_kernel_arrival", default=None)


@contextlib.contextmanager
def arriving_on(device: str | None) -> Iterator[None]:
    """Within: every tensor rebuilt here lands on `device` ("cpu": a view of the bytes that came,
    no GPU memory taken). None, and outside: as torch would put it, a tensor that left a GPU
    goes to this process's current GPU if it has one."""
    token = _arrival.set(device)
    try:
        yield
    finally:
        _arrival.reset(token)


def _rebuild_tensor(buf: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool, device: str) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    if memoryview(buf).nbytes == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    target = _arrival.get()
    if target is None:
        if device == "cuda" and torch.cuda.is_available():
            tensor = tensor.to("cuda")
    elif target != "cpu":
        tensor = tensor.to(target)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def seal(obj: Any, *, shm_dir: str | None = None, shared: bool = False, name: str | None = None) -> Sealed:
    """Pickle `obj` with its large buffers out of band.

    With `shm_dir`, buffers of SHM_THRESHOLD bytes or more are written to files there;
    `shared=True` means several receivers will map them, so the sender unlinks them
    (see Sealed.shm_paths) instead of the receiver.
    """
    if obj is None:
        return Sealed(_NONE_PICKLE)
    if _is_plain(obj):
        return Sealed(pickle.dumps(obj, protocol=5))
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = _Pickler(out, shm_dir=shm_dir, shared=shared, protocol=5, buffer_callback=buffers.append)
    try:
        pickler.dump(obj)
    except Exception as exc:  # pickling can raise nearly anything
        release(Sealed(b"", [ref for _, ref in pickler.placed.values()]))
        what = f"variable {name!r}" if name else f"a value of type {type(obj).__name__}"
        raise SerializationError(
            f"cannot send {what} to/from the mesh: {type(exc).__name__}: {exc}. "
            "Send something picklable instead (e.g. plain data, tensors, or state you "
            "can rebuild on the ranks)."
        ) from exc
    placed = pickler.placed
    raw: list[Any] = [placed[id(b)][1] if id(b) in placed else b.raw() for b in buffers]
    if shm_dir is not None:
        raw = [_to_shm(b, shm_dir, shared) if type(b) is not ShmRef and b.nbytes >= SHM_THRESHOLD else b
               for b in raw]
        # (a buffer that cannot be written to shared memory travels in the frame instead)
    return Sealed(out.getvalue(), raw)


_PLAIN_ATOMS = (int, float, bool, str, complex, type(None))


def _is_plain(obj: Any, depth: int = 0) -> bool:
    """Small builtin data that plain pickle handles as well as cloudpickle, only faster."""
    kind = type(obj)
    if kind in _PLAIN_ATOMS:
        return kind is not str or len(obj) < 4096
    if depth > 2 or len(obj) > 16 if kind in (tuple, list, dict) else True:
        return False
    if kind is dict:
        for key, value in obj.items():
            if type(key) is not str or not _is_plain(value, depth + 1):
                return False
        return True
    for value in obj:
        if not _is_plain(value, depth + 1):
            return False
    return True


def _to_shm(buf: memoryview, shm_dir: str, shared: bool) -> ShmRef | memoryview:
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
        os.link(ref.path, _hold_path(ref.path, "sender"))
    except OSError:
        return ShmRef(ref.path, ref.nbytes, unlink_on_open=False)  # the old way: release() unlinks it
    return ref


def _fill_shm(shm_dir: str, nbytes: int, shared: bool, fill: Callable[[Any], None]) -> ShmRef | None:
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
            _unlink_quietly(ref.path)
            return None
    else:
        try:
            fd = os.open(ref.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
    try:
        mapping = _MAPPINGS.get(fd, shm_dir, nbytes, write=True)  # (pages allocated first: no SIGBUS)
        if mapping is None:
            _unlink_quietly(ref.path)
            return None
        fill((ctypes.c_char * nbytes).from_address(mapping.addr))
    except BaseException:
        _unlink_quietly(ref.path)
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
        libc = _libc()
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
        _recycle(path, nbytes)

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
        libc = _libc()
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
        _unlink_quietly(path)
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
        _unlink_quietly(path)
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
        _unlink_quietly(os.path.join(shm_dir, name))
        total -= size
    return None


def _recycle(path: str, size: int, hold: str | None = None) -> None:
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


def _hold_path(path: str, who: str) -> str:
    """The hard link a holder of a shared buffer keeps: `hold-<buffer's hex>-<who>`."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"hold-{name.removeprefix('buf-')}-{who}")


def _open_shm(ref: ShmRef) -> Any:
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
        recycle = ref.recycle and _libc() is not None  # (without libc, no hook runs after the unmap)
        hold = None
        if ref.held:  # (without the unmap hook the link stays, and the file is never reused under us)
            hold = _hold_path(ref.path, f"{os.getpid()}-{secrets.token_hex(4)}")
            os.link(ref.path, hold)
        mapped = _map_private(fd, ref.nbytes,
                              on_unmap=(lambda: _recycle(ref.path, ref.nbytes, hold)) if recycle else None)
    finally:
        os.close(fd)
    if ref.unlink_on_open or (ref.recycle and not recycle and not ref.held):
        _unlink_quietly(ref.path)
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


def _map_private(fd: int, nbytes: int, on_unmap: Any = None) -> Any:
    """A copy-on-write mapping of fd's first nbytes; on_unmap runs once it is unmapped (needs libc).

    Its pages are not faulted in ahead: each receiver of a push to several ranks would pay for
    every page at once (MAP_POPULATE of 64 MiB costs more than copying it), where faults on
    first touch map the file's pages in batches, and only those the rank reads.
    """
    libc = _libc()
    if libc is None:  # portable fallback: copies pages on first write, faults lazily
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of a shared-memory buffer failed")
    array = (ctypes.c_char * nbytes).from_address(addr)
    weakref.finalize(array, _unmap, libc, addr, nbytes, on_unmap)
    return array


def _unmap(libc: Any, addr: int, nbytes: int, then: Any) -> None:
    libc.munmap(ctypes.c_void_p(addr), nbytes)
    if then is not None:
        then()  # only after the unmap: the file's next writer must not change pages we still see


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_long]
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unseal(sealed: Sealed, *, name: str | None = None) -> Any:
    """Rebuild the value inside a Sealed blob (mapping shared-memory buffers)."""
    try:
        buffers = [_open_shm(b) if isinstance(b, ShmRef) else b for b in sealed.buffers]
        return pickle.loads(sealed.data, buffers=buffers)
    except Exception as exc:
        what = f"variable {name!r}" if name else "a value"
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            raise SerializationError(
                f"cannot rebuild {what} here: it needs module {exc.name!r}, which this process cannot import. "
                "If it is your code beside the notebook, `%mesh sync` (mesh.sync_workspace()) puts it on every "
                f"host; if it is a package, install it there (`%mesh env` compares versions)."
            ) from exc
        raise SerializationError(
            f"cannot rebuild {what} here: {type(exc).__name__}: {exc}. A module or class "
            "it needs may be missing on this side; import or define it on both sides."
        ) from exc


def carries_shm_refs(msg: Any) -> bool:
    """Whether a message (fields, tuples of messages) holds a Sealed value that names shared-memory files.

    Only processes of this machine may send those: a reference from a remote host names a
    file here that the host has no business with (another mesh's buffer), so it is refused.
    Only fields that can hold a Sealed (by their annotation) are looked into: this runs on
    every message from a remote host.
    """
    kind = type(msg)
    if kind is Sealed:
        for buffer in msg.buffers:
            if type(buffer) is ShmRef:
                return True
        return False
    if kind is tuple or kind is list:
        for item in msg:
            if carries_shm_refs(item):
                return True
        return False
    names = _sealed_fields.get(kind)
    if names is None:
        names = _fields_that_may_hold_sealed(kind)
    for name in names:
        if carries_shm_refs(getattr(msg, name)):
            return True
    return False


_sealed_fields: dict[type, tuple[str, ...]] = {}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _fields_that_may_hold_sealed(kind: type) -> tuple[str, ...]:
    """The fields of a message class whose annotation allows a Sealed: it names Sealed, Any, or a
    message class with such fields itself."""
    if not dataclasses.is_dataclass(kind):
        return ()
    _sealed_fields[kind] = ()  # (a class that names itself does not recurse forever)
    scope = vars(sys.modules[kind.__module__])
    found = []
    for f in dataclasses.fields(kind):
        for name in _NAME.findall(f.type if isinstance(f.type, str) else repr(f.type)):
            named = scope.get(name)
            if name == "Any" or named is Sealed or (
                    isinstance(named, type) and named is not kind and dataclasses.is_dataclass(named)
                    and (_sealed_fields[named] if named in _sealed_fields else _fields_that_may_hold_sealed(named))):
                found.append(f.name)
                break
    _sealed_fields[kind] = tuple(found)
    return _sealed_fields[kind]


def shareable(sealed: Sealed) -> bool:
    """Whether the blob has buffers in its frame large enough to go through shared memory."""
    return any(not isinstance(b, ShmRef) and memoryview(b).nbytes >= SHM_THRESHOLD for b in sealed.buffers)


def share(sealed: Sealed, shm_dir: str) -> Sealed:
    """The same blob with its large in-frame buffers written once to shared memory for several
    receivers on this host (a host agent handing one push to all its ranks); `release` it when
    they have all answered. Buffers that cannot be written stay in the frame."""
    if not shareable(sealed):
        return sealed
    return Sealed(sealed.data, [b if isinstance(b, ShmRef) or memoryview(b).nbytes < SHM_THRESHOLD
                                else _to_shm(memoryview(b), shm_dir, shared=True) for b in sealed.buffers])


def release(sealed: Sealed) -> None:
    """Every receiver of a blob sent with shared=True has answered: drop the sender's hold on its files."""
    for ref in sealed.buffers:
        if not isinstance(ref, ShmRef):
            continue
        if ref.held:
            _recycle(ref.path, ref.nbytes, _hold_path(ref.path, "sender"))
        else:
            _unlink_quietly(ref.path)
