"""The agent's handlers of host operations (`wire/ops.py`: files in and out, workspace copies),
one per operation type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch_kernel.agent import files, workspace
from monarch_kernel.wire import ops

HANDLERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    ops.PutBegin: lambda op: files.put_begin(op.path, op.size),
    ops.PutChunk: lambda op: files.put_chunk(op.path, op.offset, op.data),
    ops.PutEnd: lambda op: files.put_end(op.path, op.size, op.sha256, op.mode, op.mtime_ns),
    ops.DescribePath: lambda op: files.describe(op.path),
    ops.ReadChunk: lambda op: files.read_chunk(op.path, op.offset, op.size),
    ops.Checksum: lambda op: files.checksum(op.path),
    ops.PrefixDigest: lambda op: files.prefix(op.path, op.length),
    ops.ListFiles: lambda op: workspace.list_files(op.key),
    ops.HashFiles: lambda op: workspace.hash_files(op.key, op.paths),
    ops.WriteFiles: lambda op: workspace.write_files(op.key, op.files, op.deletes, op.touches),
}
assert set(HANDLERS) == set(ops.HOST_OPERATIONS), "every host operation has a handler"


def run_host_operation(op: Any) -> dict[str, Any]:
    """Carry out one host operation here; its result."""
    handler = HANDLERS.get(type(op))
    if handler is None:
        raise TypeError(f"this agent has no operation {type(op).__name__} (another monarch_kernel version?)")
    return handler(op)
