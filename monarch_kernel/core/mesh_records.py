"""Records of persistent meshes: one private state file per mesh that outlives its kernel.

`$XDG_STATE_HOME/monarch_kernel/meshes/NAME.json` (`~/.local/state/...` without it), mode 0600
in a 0700 folder of the user's. It says where the mesh's agent listens (a Unix socket in a
0700 folder) and holds the mesh's secret, which a kernel proves to that agent, never sends,
to attach. The secret is worth nothing from another machine: the socket is reachable only
here, and only by this user (the agent checks the peer's uid). A record that is not a plain
file of ours, private to us, is refused, never followed through a link.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

RECORD_VERSION = 1
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


class RecordError(RuntimeError):
    """A persistent mesh's record is missing, unsafe or unreadable (the message says what to do)."""


@dataclass(frozen=True)
class MeshRecord:
    """What a kernel needs to attach to a persistent mesh (and `meshes` to list it)."""

    name: str
    kind: str  # "local", "ssh", "slurm" or "ray"
    hosts: list[str]
    gpus: int  # ranks per host
    dist: str
    persist_s: float  # how long it lives without a kernel
    created: float  # time.time() when it started
    agent_pid: int  # the agent that listens at `socket`
    socket: str
    secret: str  # hex; proved to the agent, never sent
    run_dir: str  # the mesh's private folders (logs, sockets; shared memory)
    shm_dir: str
    spec: dict[str, Any] = field(default_factory=dict)  # env, preload, health and start timeout, as started
    agents: list[dict[str, Any]] = field(default_factory=list)  # each host's: kind, socket, pid (target, options: SSH)
    version: int = RECORD_VERSION

    @property
    def shape(self) -> str:
        """{hosts: H, gpus: G} as text."""
        return f"{{hosts: {len(self.hosts)}, gpus: {self.gpus}}}"


def parse_duration(value: str | float | int) -> float:
    """Seconds from 3600, "90s", "30m" or "8h" (raises ValueError saying what is accepted)."""
    if isinstance(value, bool):
        raise ValueError(f"persist={value!r}: give a duration such as 8h, 30m, 90s or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(str(value))
        if match is None:
            raise ValueError(f"persist={value!r}: give a duration such as 8h, 30m, 90s or a number of seconds")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not seconds > 0:
        raise ValueError(f"persist={value!r}: the duration must be more than 0 seconds")
    return seconds


def format_duration(seconds: float) -> str:
    """3h 05m, 4m 10s, 12s."""
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds}s"


def records_folder(create: bool = False) -> str:
    """The folder of the records (made 0700 with `create`); refused if it is not a private folder of ours."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    folder = os.path.join(base, "monarch_kernel", "meshes")
    if create:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return folder
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RecordError(f"{folder} must be a folder of yours that only you can read (mode 0700, not a link): "
                          f"fix it with chmod 700 {folder}")
    return folder


def record_path(name: str) -> str:
    """Where mesh `name`'s record is."""
    return os.path.join(records_folder(), f"{name}.json")


def write_record(record: MeshRecord) -> str:
    """Write a record (0600, atomically; an existing one of that name is replaced); its path."""
    folder = records_folder(create=True)
    fd, temp = tempfile.mkstemp(prefix=f".{record.name}-", suffix=".json", dir=folder)  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(record), f)
        os.rename(temp, os.path.join(folder, f"{record.name}.json"))
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    return os.path.join(folder, f"{record.name}.json")


def read_record(name: str) -> MeshRecord:
    """The record of mesh `name` (raises RecordError: none, unsafe, or not one of ours)."""
    path = record_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        known = ", ".join(list_names()) or "none"
        raise RecordError(f"no persistent mesh named {name!r} (persistent meshes: {known})") from None
    except OSError as exc:
        raise RecordError(f"the record of mesh {name!r} ({path}) cannot be opened safely: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise RecordError(f"the record of mesh {name!r} ({path}) is not a private file of yours (mode 0600): "
                              "refusing it; remove it if you did not make it")
        data = f.read(1 << 20)
    try:
        raw = json.loads(data)
        if raw.get("version") != RECORD_VERSION or raw.get("name") != name:
            raise ValueError("another version or another mesh's record")
        return MeshRecord(**raw)
    except (ValueError, TypeError) as exc:
        raise RecordError(f"the record of mesh {name!r} ({path}) is not one this monarch_kernel can read ({exc}); "
                          f"remove it with python -m monarch_kernel meshes stop {name}") from None


def remove_record(name: str, agent_pid: int | None = None) -> None:
    """Remove mesh `name`'s record (only if it still names `agent_pid`, when given)."""
    path = record_path(name)
    if agent_pid is not None:
        try:
            if read_record(name).agent_pid != agent_pid:
                return  # a newer mesh of that name took the record
        except RecordError:
            return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def list_names() -> list[str]:
    """Names of the persistent meshes that have a record, sorted."""
    try:
        folder = records_folder()
        names = os.listdir(folder)
    except (OSError, RecordError):
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and not n.startswith("."))
