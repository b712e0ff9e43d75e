"""Values on the wire: cloudpickle with pickle-5 out-of-band buffers.

`seal(obj)` turns a user value into a `Sealed` blob whose large buffers (tensor and
numpy data) stay out of band, so they are sent with scatter-gather writes and never
copied into the pickle stream. Between processes of one host, buffers over
`SHM_THRESHOLD` go through a file in a private shared-memory folder instead, which
the receiver maps copy-on-write: one memcpy in total for a push or a pull.

Hosts agents forward Sealed blobs without unpickling them.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from monarch_kernel.core.errors import SerializationError

SHM_THRESHOLD = 1 << 20  # buffers from 1 MiB go through shared memory on one host
_NONE_PICKLE = pickle.dumps(None, protocol=5)


@dataclass(frozen=True)
class ShmRef:
    """A buffer that was written to a file under a private shared-memory folder."""

    path: str
    nbytes: int
    unlink_on_open: bool


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
    """cloudpickle, plus CPU/GPU tensors sent as raw out-of-band bytes."""

    def reducer_override(self, obj: Any) -> Any:
        """Code keeps its file name; plain CPU/GPU tensors travel as raw buffers."""
        if type(obj) is types.CodeType:
            # cloudpickle renames code to "<dynamic-code>"; keep the real file name so
            # remote tracebacks can show the notebook's lines (shipped to linecache)
            rebuild, args = self.dispatch_table[types.CodeType](obj)
            return rebuild, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = _reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def _reduce_tensor(torch: Any, t: Any) -> tuple[Any, ...] | None:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return None
    if t.requires_grad and not t.is_leaf:
        return None  # let torch raise its own clear error
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
    return (
        _rebuild_tensor,
        (pickle.PickleBuffer(raw), str(t.dtype).removeprefix("torch."), tuple(t.shape),
         t.requires_grad, t.device.type),
    )


def _rebuild_tensor(buf: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool, device: str) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    if memoryview(buf).nbytes == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    if device == "cuda" and torch.cuda.is_available():
        tensor = tensor.to("cuda")
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
    try:
        _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    except Exception as exc:  # pickling can raise nearly anything
        what = f"variable {name!r}" if name else f"a value of type {type(obj).__name__}"
        raise SerializationError(
            f"cannot send {what} to/from the mesh: {type(exc).__name__}: {exc}. "
            "Send something picklable instead (e.g. plain data, tensors, or state you "
            "can rebuild on the ranks)."
        ) from exc
    raw: list[Any] = [b.raw() for b in buffers]
    if shm_dir is not None:
        raw = [_to_shm(b, shm_dir, shared) if b.nbytes >= SHM_THRESHOLD else b for b in raw]
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
    """
    path = os.path.join(shm_dir, "buf-" + secrets.token_hex(8))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return buf
    try:
        view = memoryview(buf).cast("B")
        written = 0
        while written < view.nbytes:
            written += os.write(fd, view[written:])
    except OSError:
        _unlink_quietly(path)
        return buf
    finally:
        os.close(fd)
    return ShmRef(path, memoryview(buf).nbytes, unlink_on_open=not shared)


def _open_shm(ref: ShmRef) -> Any:
    """Map a shared-memory buffer privately (copy-on-write) with its pages pre-faulted.

    Pre-faulting a *writable* private mapping would copy every page, so the pages are
    mapped read-only first (no copy), then the mapping is made writable: a page is only
    copied if the receiver writes to it.
    """
    _check_shm_path(ref)
    fd = os.open(ref.path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_size < ref.nbytes:
            raise ValueError(f"{ref.path} is not one of our buffers of {ref.nbytes} bytes")
        mapped = _map_private(fd, ref.nbytes)
    finally:
        os.close(fd)
    if ref.unlink_on_open:
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


def _map_private(fd: int, nbytes: int) -> Any:
    libc = _libc()
    if libc is None:  # portable fallback: copies pages on first write, faults lazily
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    addr = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_PRIVATE | populate, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of a shared-memory buffer failed")
    if libc.mprotect(ctypes.c_void_p(addr), nbytes, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        libc.munmap(ctypes.c_void_p(addr), nbytes)
        raise OSError(ctypes.get_errno(), "mprotect of a shared-memory buffer failed")
    array = (ctypes.c_char * nbytes).from_address(addr)
    weakref.finalize(array, libc.munmap, ctypes.c_void_p(addr), nbytes)
    return array


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
    """
    if isinstance(msg, Sealed):
        return any(isinstance(b, ShmRef) for b in msg.buffers)
    if isinstance(msg, tuple):
        return any(carries_shm_refs(item) for item in msg)
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return any(carries_shm_refs(getattr(msg, f.name)) for f in dataclasses.fields(msg))
    return False


def release(sealed: Sealed) -> None:
    """Remove the shared-memory files of a blob sent with shared=True."""
    for path in sealed.shm_paths():
        _unlink_quietly(path)
