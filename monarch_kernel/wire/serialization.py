"""Values on the wire: cloudpickle with pickle-5 out-of-band buffers.

`seal(obj)` turns a user value into a `Sealed` blob whose large buffers (tensor and
numpy data) stay out of band, so they are sent with scatter-gather writes and never
copied into the pickle stream. Between processes of one host, buffers over
`SHM_THRESHOLD` go through a file in a private shared-memory folder instead, which
the receiver maps copy-on-write: one memcpy in total for a push or a pull.

The files, their recycling and the mappings kept of them are `shm_pool.py`'s.

Hosts agents forward Sealed blobs without unpickling them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import io
import pickle
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from monarch_kernel.core.errors import SerializationError
from monarch_kernel.wire.shm_pool import (
    SHM_THRESHOLD,
    ShmRef,
    fill_shm,
    forget_mappings,
    hold_path,
    open_shm,
    recycle,
    to_shm,
    unlink_quietly,
)

__all__ = ["SHM_THRESHOLD", "Sealed", "ShmRef", "arriving_on", "carries_shm_refs", "forget_mappings", "release",
           "seal", "share", "shareable", "unseal"]

_NONE_PICKLE = pickle.dumps(None, protocol=5)


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

        ref = fill_shm(self.shm_dir, nbytes, self.shared, fill)
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
        raw = [to_shm(b, shm_dir, shared) if type(b) is not ShmRef and b.nbytes >= SHM_THRESHOLD else b
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


def unseal(sealed: Sealed, *, name: str | None = None) -> Any:
    """Rebuild the value inside a Sealed blob (mapping shared-memory buffers)."""
    try:
        buffers = [open_shm(b) if isinstance(b, ShmRef) else b for b in sealed.buffers]
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
                                else to_shm(memoryview(b), shm_dir, shared=True) for b in sealed.buffers])


def release(sealed: Sealed) -> None:
    """Every receiver of a blob sent with shared=True has answered: drop the sender's hold on its files."""
    for ref in sealed.buffers:
        if not isinstance(ref, ShmRef):
            continue
        if ref.held:
            recycle(ref.path, ref.nbytes, hold_path(ref.path, "sender"))
        else:
            unlink_quietly(ref.path)
