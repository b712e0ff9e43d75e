"""A rank's collectives: their progress (torch's flight recorder), freeing a main thread stuck in
one (the stop button), and a fresh default process group afterwards.

Progress is read in-process from the flight recorder (on by default, gloo included): per
process group, the last collective entered and completed (`pg_status`) and the unfinished
entries' kind and tensors. Nothing listens on a port for it.

A stop reaches a rank waiting in a gloo collective as SIGINT, but gloo waits in C++ and
checks no signal, and aborting a gloo group does not end work in flight. So the sockets of
the rank's gloo groups (the pair connections made while a group was created, not the
rendezvous store's and not listeners) are shut down: the wait fails at once. NCCL groups
are aborted, which NCCL supports. Either way the groups are broken on every rank, so the
notebook then has every rank make a fresh default group through the mesh's own store
(`rebuild_default_group`); groups the user made are gone, and named.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from monarch_kernel.core.hangs import GroupProgress

_group_sockets: set[tuple[int, int]] = set()  # (fd, inode) of gloo pair connections made while groups were created
_lock = threading.Lock()


def progress(with_entries: bool = True) -> tuple[tuple[GroupProgress, ...], str]:
    """Each process group's progress on this rank, and why there is none ("" if there is).

    Without entries (microseconds, where the entries of a full recorder take hundreds of ms) the
    figures are the groups' counters only, one per group torch has made, named by its id."""
    torch = sys.modules.get("torch")
    if torch is None:
        return (), "torch is not imported on this rank"
    tdist = torch.distributed
    if not tdist.is_available() or not tdist.is_initialized():
        return (), "no process group on this rank"
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        return (), f"torch {torch.__version__} has no flight recorder: no collective progress to show"
    try:
        data = json.loads(dump(includeCollectives=with_entries, onlyActive=True))
    except Exception as exc:  # noqa: BLE001 - said, not raised: the rest of the report still counts
        return (), f"the flight recorder could not be read ({type(exc).__name__}: {exc})"
    status = {str(k): v for k, v in data.get("pg_status", {}).items()}  # keyed by torch's id of each group made
    if not with_entries:
        return tuple(GroupProgress(pg_id, "", (), max(0, int(v.get("last_enqueued_collective", 0))),
                                   max(0, int(v.get("last_completed_collective", 0))))
                     for pg_id, v in sorted(status.items())), ""
    groups = _groups_by_name(tdist)
    names: dict[str, tuple[str, str]] = {}  # group id -> (its name, its description), from the entries
    first_pending: dict[str, dict[str, Any]] = {}
    for entry in data.get("entries", ()):
        pg_id, seq = str(entry.get("pg_id", "")), int(entry.get("collective_seq_id", 0))
        group = entry.get("process_group") or ["", ""]
        names[pg_id] = (str(group[0]), str(group[1]) if len(group) > 1 else "")
        if entry.get("is_p2p") or seq <= int(status.get(pg_id, {}).get("last_completed_collective", 0)):
            continue
        if pg_id not in first_pending or seq < first_pending[pg_id]["collective_seq_id"]:
            first_pending[pg_id] = entry
    newest: dict[str, str] = {}  # a name that was made again (a remade default group) means its newest id
    for pg_id in sorted(status, key=_as_int):
        name = names.get(pg_id, (pg_id, ""))[0]
        if name in groups:
            newest[name] = pg_id
    now_ns = time.time_ns()
    out = []
    for name, pg_id in sorted(newest.items()):
        figures = status[pg_id]
        desc, ranks = groups[name]
        entered = max(0, int(figures.get("last_enqueued_collective", 0)))
        completed = max(0, int(figures.get("last_completed_collective", 0)))
        entry = first_pending.get(pg_id)
        op = what = ""
        for_s = 0.0
        if entry is not None:
            op = str(entry.get("profiling_name", "")).split(":")[-1]
            what = _tensors(entry)
            created = int(entry.get("time_created_ns") or 0)
            for_s = max(0.0, (now_ns - created) / 1e9) if created else 0.0
        out.append(GroupProgress(name, desc or names.get(pg_id, ("", ""))[1], ranks, entered, completed, op, what,
                                 for_s))
    return tuple(out), ""


def _as_int(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _groups_by_name(tdist: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """torch's name of each group this rank is in -> (description, global ranks)."""
    c10d = tdist.distributed_c10d
    found = {}
    for pg, name in list(c10d._world.pg_names.items()):
        try:
            ranks = tuple(tdist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group torch no longer knows
            continue
        found[str(name)] = (str(getattr(pg, "group_desc", "") or ""), ranks)
    return found


def _tensors(entry: dict[str, Any]) -> str:
    sizes, dtypes = entry.get("input_sizes") or [], entry.get("input_dtypes") or []
    if not sizes:
        return ""
    count = sum(_numel(s) for s in sizes)
    kind = str(dtypes[0]).lower() if dtypes else "element"
    kind = {"float": "float", "double": "double", "long": "int64", "int": "int32", "half": "half",
            "bfloat16": "bfloat16", "bool": "bool"}.get(kind, kind)
    return f"{count} {kind}{'s' if count != 1 else ''}"


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_pending_since: dict[str, tuple[int, float]] = {}  # group id -> (the collective pending, since when: monotonic)
_described: dict[tuple[str, int], str] = {}  # (group id, sequence number) -> "all_reduce #58 (default group)"
STATUS_AFTER_S = 1.0  # a collective pending this long shows in the rank's status
STATUS_SWITCH = "MONARCH_KERNEL_COLLECTIVE_STATUS"  # "off": heartbeats do not say which collective a rank waits in


def brief() -> str:
    """One phrase for the rank's status while it has waited in a collective for STATUS_AFTER_S or more
    ("" otherwise). Called at every heartbeat, so it reads only the groups' counters (microseconds);
    the flight recorder's entries (hundreds of ms with a full buffer) are read once per stuck collective."""
    torch = sys.modules.get("torch")
    # (torch.distributed is missing, or half made, while a cell is still importing torch)
    is_initialized = getattr(sys.modules.get("torch.distributed"), "is_initialized", None)
    if torch is None or is_initialized is None or not is_initialized():
        return ""
    if os.environ.get(STATUS_SWITCH, "").lower() in ("off", "0", "false"):
        return ""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return ""
    try:
        status = json.loads(dump(includeCollectives=False)).get("pg_status", {})
    except Exception:  # noqa: BLE001 - a status line is not worth an error
        return ""
    now = time.monotonic()
    pending = {}
    for pg_id, figures in status.items():
        done = max(0, int(figures.get("last_completed_collective", 0)))  # (a group that finished none says -1)
        if int(figures.get("last_enqueued_collective", 0)) > done:
            pending[str(pg_id)] = done + 1
    for pg_id in list(_pending_since):
        if pending.get(pg_id) != _pending_since[pg_id][0]:
            del _pending_since[pg_id]
    for pg_id, seq in pending.items():
        _pending_since.setdefault(pg_id, (seq, now))
    stuck = sorted((since, pg_id, seq) for pg_id, (seq, since) in _pending_since.items() if now - since >= STATUS_AFTER_S)
    if not stuck:
        return ""
    since, pg_id, seq = stuck[0]
    key = (pg_id, seq)
    if key not in _described:
        _described.clear()
        groups, _ = progress()
        found = next((g for g in groups if g.waiting and g.completed + 1 == seq), None)
        _described[key] = f"{found.op or 'a collective'} #{seq} ({found.label})" if found else f"collective #{seq}"
    return f"in {_described[key]} for {now - since:.0f}s"


# ---------------------------------------------------------------- freeing a stuck main thread


def track_group_sockets() -> None:
    """Note the TCP connections each new process group makes (call before the mesh's group is made)."""
    torch_c10d: Any = sys.modules["torch.distributed.distributed_c10d"]
    original = torch_c10d._new_process_group_helper
    if getattr(original, "__monarch_kernel__", False):
        return

    def helper(*args: Any, **kwargs: Any) -> Any:
        before = _tcp_connections()
        try:
            return original(*args, **kwargs)
        finally:
            with _lock:
                _group_sockets.update(_tcp_connections() - before)

    helper.__monarch_kernel__ = True  # type: ignore[attr-defined]
    torch_c10d._new_process_group_helper = helper


def free_main_thread(tell: Callable[[str], None] | None = None) -> str:
    """End the collective the main thread waits in, if it does: see `free_thread`."""
    return free_thread(threading.main_thread().ident or 0, tell)


def free_thread(thread: int, tell: Callable[[str], None] | None = None) -> str:
    """End the collective thread `thread` waits in, if it does (a stop cannot reach into its wait): how
    it was ended, told first to `tell`; "" when it waits in none (any thread). NCCL returns from a
    collective at once and waits later (a synchronize, the tensor's next use), so an NCCL group with a
    collective entered and not completed counts too."""
    if not (thread_in_collective(thread) or _nccl_work_pending()):
        return ""
    text = ending_text()
    if tell is not None:
        tell(text)
    try:
        store_port: int | None = int(os.environ["MASTER_PORT"])  # the rendezvous store's link is kept
    except (KeyError, ValueError):
        store_port = None
    abort_collectives(store_port)
    return text


def _nccl_work_pending() -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        return False
    groups, _ = progress(with_entries=False)
    return any(group.waiting for group in groups)


def thread_in_collective(thread: int) -> bool:
    """Whether thread `thread` is inside a torch.distributed call now (a collective or its wait)."""
    top = sys._current_frames().get(thread)
    chain: list[FrameType] = []
    while top is not None and len(chain) < 8:
        chain.append(top)
        top = top.f_back
    return in_collective(list(reversed(chain)))


def broken_by_peer(exc: BaseException) -> str:
    """How the groups are broken if `exc` was raised inside a torch.distributed collective (a peer's stop
    closed or aborted the group under it), "" otherwise: such a rank's collective was ended too."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_initialized():
        return ""
    frames: list[Any] = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return ending_text() if frames and in_collective(frames) else ""


def in_collective(frames: list[Any]) -> bool:
    """Whether a stack (innermost last) is inside a torch.distributed collective or its wait."""
    return any("torch/distributed/" in f.f_code.co_filename for f in frames[-6:])


def ending_text() -> str:
    """What abort_collectives does here, for the notebook."""
    torch = sys.modules.get("torch")
    nccl = torch is not None and torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    return "its NCCL process groups aborted" if nccl else "its gloo process groups' connections closed"


def abort_collectives(store_port: int | None) -> None:
    """End the collectives this rank waits in (reader thread)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.distributed_c10d._abort_process_group()
        return
    with _lock:
        held = sorted(_group_sockets)
    for fd, inode in held:
        _shut(fd, inode, store_port)


def _shut(fd: int, inode: int, store_port: int | None) -> int:
    try:
        if os.fstat(fd).st_ino != inode:
            return 0  # closed with its group; the number now names something else
        sock = socket.socket(fileno=fd)
    except OSError:
        return 0
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return 0  # a listener: gloo's own thread would die on it
        if store_port is not None and sock.getpeername()[1] == store_port:
            return 0  # the rendezvous store: the fresh group needs it
        sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        sock.detach()


def forget_group_sockets() -> None:
    """The groups were destroyed: their sockets with them."""
    with _lock:
        _group_sockets.clear()


def _tcp_connections() -> set[tuple[int, int]]:
    """This process's TCP sockets: (fd, inode)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                found.add((int(name), os.fstat(int(name)).st_ino))
        finally:
            sock.detach()
    return found
