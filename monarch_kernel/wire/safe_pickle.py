"""What a frame may contain: an unpickler that builds only the runtime's own message types.

Frames carry the runtime's messages (dataclasses, enums and exceptions of `monarch_kernel`)
and plain data; user values travel inside them as sealed bytes that are unpickled only
when the user asks for them. So a frame that names any other global (`os.system`, a
function of ours, a class with side effects) is refused: a peer with another version, a
bug or a forged frame cannot run code in the receiver just by sending a message.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
from typing import Any

_PLAIN = {
    ("builtins", name) for name in (
        "tuple", "list", "dict", "set", "frozenset", "bytes", "bytearray", "str", "int", "float",
        "complex", "bool", "slice", "range", "object",
    )
} | {("copyreg", "_reconstructor"), ("collections", "OrderedDict"), ("datetime", "timedelta"),
     # rebuilds a message of an allowed class from its field values (wire/message_pickling.py)
     ("monarch_kernel.wire.message_pickling", "rebuild")}

_OUR_MODULES = ("monarch_kernel.",)


class ForbiddenGlobal(pickle.UnpicklingError):
    """A frame names a global outside the runtime's own message types."""


def allowed(module: str, name: str) -> Any:
    """The object a frame may name as module.name; raises ForbiddenGlobal for anything else."""
    if (module, name) in _PLAIN:
        return getattr(importlib.import_module(module), name)
    if module.startswith(_OUR_MODULES) and "." not in name:
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, (enum.Enum, BaseException))):
            return obj
    raise ForbiddenGlobal(f"a frame named {module}.{name}, which is not a message type of monarch_kernel")


class MessageUnpickler(pickle.Unpickler):
    """pickle.Unpickler limited to `allowed` globals."""

    def find_class(self, module: str, name: str) -> Any:
        """Only message types and plain data."""
        return allowed(module, name)


def loads(data: bytes | bytearray, buffers: list[Any]) -> Any:
    """Unpickle a frame's message (protocol 5, out-of-band buffers) with the restricted unpickler."""
    return MessageUnpickler(io.BytesIO(data), buffers=buffers).load()
