"""The first frame an agent sends: which monarch_kernel and which wire protocol it speaks.

It is a plain tuple, so that any version can read any other's: a host with another
version of the package is named in a clear error at start, instead of frames being
misread later (the hot messages travel as positional tuples).
"""

from __future__ import annotations

import hashlib
from dataclasses import fields, is_dataclass
from typing import Any

from monarch_kernel.wire import actor_messages, debugging, diagnosis, flat, messages, ops, persist_messages, relay_messages

TAG = "monarch_kernel hello"


def _protocol_digest() -> str:
    """A digest of every message type and internal operation with its fields, in order (what both
    ends must agree on)."""
    parts = [f"{cls.__name__}({','.join(f.name for f in fields(cls))})"
             for module in (messages, actor_messages, relay_messages, diagnosis, debugging, ops, persist_messages)
             for cls in vars(module).values()
             if isinstance(cls, type) and cls.__module__ == module.__name__ and is_dataclass(cls)]
    parts.append("flat:" + ",".join(cls.__name__ for cls in flat.FLAT_TYPES))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


PROTOCOL = _protocol_digest()


def hello(version: str) -> tuple[str, str, str]:
    """The agent's first frame."""
    return (TAG, version, PROTOCOL)


def mismatch(msg: Any, host: str, version: str) -> str | None:
    """Why the first frame from `host` shows an agent this controller cannot talk to (None: it can)."""
    if not (isinstance(msg, tuple) and len(msg) == 3 and msg[0] == TAG):
        return (f"the agent on {host} runs an older monarch_kernel (it did not say which); install "
                f"monarch_kernel {version} there, or start the mesh with ship_package=True (--ship)")
    _, theirs, protocol = msg
    if protocol != PROTOCOL:
        return (f"the agent on {host} runs monarch_kernel {theirs} (wire protocol {protocol}), this kernel "
                f"{version} (protocol {PROTOCOL}); install the same version on both, or use ship_package=True (--ship)")
    return None
