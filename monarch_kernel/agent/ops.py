"""The agent's handlers of host operations (`wire/ops.py`: files in and out, workspace copies),
one per operation type."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from monarch_kernel.agent import files, workspace
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import ops

HANDLERS: dict[type, Callable[[Any], ops.HostOperationResult]] = {
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
    ops.NativeStacks: lambda op: native_stacks(op.pids),
}
assert set(HANDLERS) == set(ops.HOST_OPERATIONS), "every host operation has a handler"


def native_stacks(pids: tuple[int, ...], timeout: float = 20.0) -> ops.NativeStacksFound:
    """py-spy's dump of each process, native frames included (or why there is none)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if found is None:
        return ops.NativeStacksFound({}, f"py-spy is not installed on host {socket.gethostname()}: pip install py-spy "
                                         f"(into {sys.prefix}), then ask again")
    stacks: dict[int, str] = {}
    for pid in pids:
        try:
            done = subprocess.run([found, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=timeout)
            stacks[pid] = done.stdout if done.returncode == 0 else f"py-spy failed: {done.stderr.strip()}"
        except subprocess.TimeoutExpired:
            stacks[pid] = f"py-spy did not finish within {timeout:.0f} s"
    return ops.NativeStacksFound(stacks)


def run_host_operation(op: Any) -> ops.HostOperationResult:
    """Carry out one host operation here; its result."""
    handler = HANDLERS.get(type(op))
    if handler is None:
        raise TypeError(f"this agent has no operation {type(op).__name__} (another monarch_kernel version?)")
    return handler(op)


class HostOperations:
    """Host operations run one at a time, in order, off the agent's loop."""

    def __init__(self) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, msg: m.HostOp, answer: Callable[[m.HostOpDone], None]) -> None:
        """Carry out `msg.op`; its result (or why it failed) goes to `answer`."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-op")
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._thread, run_host_operation, msg.op)
        except Exception as exc:  # noqa: BLE001 - the controller gets the reason
            answer(m.HostOpDone(msg.op_id, None, f"{type(exc).__name__}: {exc}"))
        else:
            answer(m.HostOpDone(msg.op_id, result))
