"""Values several ranks of a host receive, written once to the host's shared memory.

A push (or call) for several ranks of one host is copied once into a private folder of the
agent's in /dev/shm, which each rank maps, instead of once per rank through its socket. The copy
runs on a thread of its own (2.3 s/GiB on a small machine): the agent's loop goes on answering
pings and passing output meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
from typing import Any

from monarch_kernel.core.folders import owned_folder, private_shm_dir, release_folder, sweep_stale_folders
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.serialization import Sealed, share, shareable

SHARED_FIELDS = {m.Push: "values", m.Call: "fn", m.ActorCall: "args"}  # where their large values are


class HostShm:
    """The agent's shared-memory folder (made with the first value worth sharing) and its copier."""

    def __init__(self) -> None:
        self.folder: str | None = None
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None

    @staticmethod
    def worth_sharing(body: Any) -> bool:
        """Whether a message carries values large enough to share."""
        field_name = SHARED_FIELDS.get(type(body))
        return field_name is not None and shareable(getattr(body, field_name))

    @staticmethod
    def shared_value(body: Any) -> Sealed:
        """The sealed value a shared message carries (to release once every rank answered)."""
        return getattr(body, SHARED_FIELDS[type(body)])

    def share(self, body: Any) -> tuple[Any, Exception | None]:
        """The message with its large values in shared memory, and the problem that kept them in
        the frame, if any (runs on any thread; reports nothing itself)."""
        field_name = SHARED_FIELDS.get(type(body))
        if field_name is None:
            return body, None
        sealed = getattr(body, field_name)
        if not shareable(sealed):
            return body, None
        if self.folder is None:
            sweep_stale_folders()  # ours from agents that were killed
            try:
                self.folder = owned_folder(private_shm_dir(f"agent-{os.getpid()}"))
            except OSError as exc:  # /dev/shm full (Docker's default is 64 MB): the bytes go in each frame
                return body, exc
        shared = share(sealed, self.folder)
        return (body if shared is sealed else dataclasses.replace(body, **{field_name: shared})), None

    async def share_off_loop(self, body: Any) -> tuple[Any, Exception | None]:
        """`share`, on the copier thread."""
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-copy")
        return await asyncio.get_running_loop().run_in_executor(self._copier, self.share, body)

    def close(self) -> None:
        """Remove the folder (the ranks are gone)."""
        if self.folder is not None:
            release_folder(self.folder)
            self.folder = None
        if self._copier is not None:
            self._copier.shutdown(wait=False)
