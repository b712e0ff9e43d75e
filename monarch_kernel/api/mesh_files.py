"""The user's files on a mesh's hosts: `Mesh.sync_workspace`, `put`, `get`, `environment` and
`autoreload` (a part of `Mesh`, kept here by idea)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from monarch_kernel.api import environment, transfer, workspace
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.wire.ops import RankOperation


class HostFiles:
    """What `Mesh` does with the user's files (it provides `_runtime`, `ranks` and `_ask_on`)."""

    _runtime: MeshRuntime
    ranks: Any
    _ask_on: Callable[[list[int], RankOperation, str], Any]  # runs an operation on these ranks of the whole mesh

    def sync_workspace(self, path: str | None = None, *, exclude: Sequence[str] = (), auto: bool = False,
                       chdir: bool = False, force: bool = False,
                       max_bytes: int = workspace.DEFAULT_MAX_BYTES) -> workspace.SyncReport:
        """Copy a folder (default: the notebook's project) to every host, and put it first on the ranks' sys.path.

        Once per host, all hosts at once, over the mesh's own connections; only files that
        changed since the last sync travel (size, mtime, content hash); deleted files are
        deleted; `.gitignore` rules and `exclude` patterns apply; symlinks leading outside
        are skipped. Hosts on this machine share the folder and get no copy. `auto=True`
        sends changes before each mesh cell; `chdir=True` makes it the ranks' working
        folder. A folder over `max_bytes` is refused (naming its largest files) unless `force`.
        """
        return workspace.sync(self._runtime, self._ask_on, path, exclude=exclude, auto=auto, chdir=chdir,
                              force=force, max_bytes=max_bytes)

    def put(self, src: str, dst: str) -> transfer.TransferReport:
        """Copy a local file or folder to path `dst` (absolute, or ~/...) on every host of this mesh or slice.

        Once per host, all hosts at once, streamed in checksummed chunks with a progress
        line; an interrupted put goes on from where it stopped the next time.
        """
        return transfer.put(self._runtime, src, dst, list(self.ranks))

    def get(self, src: str, dst_dir: str = ".") -> transfer.TransferReport:
        """Bring path `src` (absolute, or ~/...) from the hosts of this mesh or slice into local folder `dst_dir`.

        Each host's copy lands as `NAME.host-H`; a path naming `{rank}` or `{local_rank}`
        is fetched per rank as `NAME.rank-R`. Streamed, checksummed and resumable like `put`.
        """
        return transfer.get(self._runtime, src, dst_dir, list(self.ranks))

    def environment(self) -> environment.EnvReport:
        """Python, torch, cloudpickle and monarch_kernel versions of each host next to the notebook's."""
        return environment.check(self._runtime, self._ask_on)

    def autoreload(self, on: bool = True) -> None:
        """Reload changed modules of the synced folders on every rank before each cell (IPython's %autoreload 2)."""
        workspace.set_autoreload(self._runtime, self._ask_on, on)
