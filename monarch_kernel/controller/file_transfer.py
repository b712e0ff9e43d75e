"""`Mesh.put` and `Mesh.get`, the controller's side: files to and from one host, chunk by chunk.

Runs on the controller loop, one coroutine per host, all hosts at once. Files move in
chunks of CHUNK bytes with WINDOW of them in flight, so a 10 GB checkpoint never sits
whole in memory on either side; both ends hash what they move (sha256) and a file is put
in place only when the hashes match. An interrupted transfer leaves `NAME.monarch-partial`
behind; the next one checks that the partial file is a prefix of the real one (by hash)
and goes on from there. The agent's side is `agent.files`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.controller.host_ops import HostOps, Progress
from monarch_kernel.controller.state import HostLink
from monarch_kernel.core.partial_files import finish_partial, open_partial, resumable_size
from monarch_kernel.core.workspace import prefix_digest, safe_relative
from monarch_kernel.wire.ops import Checksum, DescribePath, PrefixDigest, PutBegin, PutChunk, PutEnd, ReadChunk

CHUNK = 8 << 20
WINDOW = 4
PARTIAL = ".monarch-partial"


@dataclass
class TransferResult:
    """What a put or get did on one host."""

    host: str
    files: list[str] = field(default_factory=list)  # where each file landed
    bytes_moved: int = 0
    bytes_resumed: int = 0  # already there from an interrupted transfer
    errors: list[str] = field(default_factory=list)


def _read(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def local_files(src: str) -> list[tuple[str, str]]:
    """(local path, relative name) of a file, or of every regular file under a folder (no symlinks)."""
    if not os.path.isdir(src):
        return [(src, "")]
    out = []
    for folder, _dirs, names in os.walk(src):
        for name in sorted(names):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append((path, os.path.relpath(path, src).replace(os.sep, "/")))
    return out


async def _windowed(items: list[Any], start: Callable[[Any], asyncio.Future[Any]],
                    finish: Callable[[Any, Any], Any]) -> None:
    """start(item) for each item with at most WINDOW in flight; finish(item, result) in order."""
    in_flight: list[tuple[Any, asyncio.Future[Any]]] = []
    try:
        for item in items:
            in_flight.append((item, start(item)))
            while len(in_flight) >= WINDOW:
                first, future = in_flight.pop(0)
                result = finish(first, await future)
                if asyncio.iscoroutine(result):
                    await result
        while in_flight:
            first, future = in_flight.pop(0)
            result = finish(first, await future)
            if asyncio.iscoroutine(result):
                await result
    finally:
        for _, future in in_flight:
            future.cancel()


async def put_host(ops: HostOps, link: HostLink, src: str, dst: str, progress: Progress) -> TransferResult:
    """Copy a local file or folder to path `dst` on one host."""
    result = TransferResult(link.name)
    files = local_files(src)
    progress.files_total = len(files)
    progress.bytes_total = sum(os.path.getsize(path) for path, _ in files)
    for path, rel in files:
        target = dst if not rel else f"{dst.rstrip('/')}/{safe_relative(rel)}"
        try:
            await _put_file(ops, link, path, target, progress, result)
            result.files.append(target)
        except (OSError, RuntimeError) as exc:
            result.errors.append(f"{target}: {exc}")
        progress.files_done += 1
    return result


async def _put_file(ops: HostOps, link: HostLink, path: str, target: str, progress: Progress,
                    result: TransferResult) -> None:
    info = os.stat(path)
    size = info.st_size
    begin = await ops.send(link, PutBegin(target, size))
    digest, offset = hashlib.sha256(), 0
    if begin.partial:
        ours = await asyncio.to_thread(prefix_digest, path, begin.partial)
        if ours is not None and ours.hexdigest() == begin.sha256:
            digest, offset = ours, begin.partial
            result.bytes_resumed += offset
            progress.bytes_done += offset
    offsets = list(range(offset, size, CHUNK)) or [0]

    previous: list[asyncio.Future[None] | None] = [None]

    def start(at: int) -> asyncio.Future[Any]:
        before, queued = previous[0], asyncio.get_running_loop().create_future()
        previous[0] = queued

        async def send() -> bytes:
            data = await asyncio.to_thread(_read, path, at, min(CHUNK, size - at))
            if before is not None:
                await before  # chunks go out in file order (the reads may finish in any order)
            answer = ops.send(link, PutChunk(target, at, pickle.PickleBuffer(data)))
            queued.set_result(None)
            await answer
            return data
        return asyncio.ensure_future(send())

    async def finish(_at: int, data: bytes) -> None:
        await asyncio.to_thread(digest.update, data)  # in file order; off the loop (hashlib lets go of the GIL)
        progress.bytes_done += len(data)
        result.bytes_moved += len(data)

    await _windowed(offsets, start, finish)
    await ops.send(link, PutEnd(target, size, digest.hexdigest(), info.st_mode, info.st_mtime_ns))


async def get_host(ops: HostOps, link: HostLink, src: str, dst: str, progress: Progress) -> TransferResult:
    """Copy path `src` of one host (a file, or a folder's files) to the local path `dst`."""
    result = TransferResult(link.name)
    described = await ops.send(link, DescribePath(src))
    remote = described.path
    files, modes = described.files, described.modes
    progress.files_total = len(files)
    progress.bytes_total = sum(files.values())
    for rel, size in files.items():
        try:
            local = dst if not rel else os.path.join(dst, *safe_relative(rel).split("/"))
            await _get_file(ops, link, f"{remote}/{rel}" if rel else remote, local, size, progress, result,
                            mode=modes.get(rel, 0o600) & 0o777)
            result.files.append(local)
        except (OSError, RuntimeError, ValueError) as exc:
            result.errors.append(f"{rel or remote}: {exc}")
        progress.files_done += 1
    return result


async def _get_file(ops: HostOps, link: HostLink, remote: str, local: str, size: int, progress: Progress,
                    result: TransferResult, mode: int = 0o600) -> None:
    """One file into `local`, through a private partial file (core/partial_files.py); it gets
    the host file's mode at the end (a 0600 file stays 0600 here)."""
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    partial = local + PARTIAL
    digest, offset = hashlib.sha256(), 0
    have = resumable_size(partial)
    if 0 < have <= size:
        theirs = await ops.send(link, PrefixDigest(remote, have))
        ours = await asyncio.to_thread(prefix_digest, partial, have)
        if ours is not None and ours.hexdigest() == theirs.sha256:
            digest, offset = ours, have
            result.bytes_resumed += have
            progress.bytes_done += have
    with os.fdopen(open_partial(partial, resume=offset > 0), "r+b") as out:
        out.seek(offset)

        def start(at: int) -> asyncio.Future[Any]:
            return ops.send(link, ReadChunk(remote, at, min(CHUNK, size - at)))

        async def finish(_at: int, answer: Any) -> None:
            data = answer.data
            def take() -> None:
                digest.update(data)
                out.write(data)

            await asyncio.to_thread(take)
            progress.bytes_done += len(data)
            result.bytes_moved += len(data)

        await _windowed(list(range(offset, size, CHUNK)), start, finish)
        out.truncate(size)
        out.flush()
        check = await ops.send(link, Checksum(remote))
        if check.size != size or check.sha256 != digest.hexdigest():
            os.unlink(partial)
            raise RuntimeError("the file changed on the host while it was read (checksums differ); get it again")
        finish_partial(out.fileno(), partial, local, mode)
