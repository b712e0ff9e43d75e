"""The kernel's side of the Meshes sidebar: a Jupyter comm target, `monarch_kernel.meshes`.

A frontend (the JupyterLab extension) opens a comm to this target; no server port or
dashboard URL is involved, so it works wherever the kernel's own channels do.

Messages (JSON), frontend -> kernel:
  {"type": "refresh"}                                   -> a "meshes" message
  {"type": "action", "action": "interrupt"|"restart"|"down", "mesh": NAME}
  {"type": "action", "action": "logs", "mesh": NAME, "rank": R, "lines": N}
  {"type": "action", "action": "why", "mesh": NAME}   (why the ranks are where they are: %mesh why)
  {"type": "action", "action": "debug", "mesh": NAME, "rank": R}   (JupyterLab's debugger stops in rank R:
      %mesh debug rank R)
kernel -> frontend:
  {"type": "meshes", "version": 1, "meshes": [MESH, ...]}   on open, on refresh, and
      whenever more than ranks changed (a mesh came or went, its state or job line)
  {"type": "ranks", "version": 1, "changes": {NAME: [RANK, ...]}}   only the ranks that
      changed otherwise (checked twice a second while the comm is open); changes of load
      (cpu, rss, GPU) and busy detail count every 2 s
  {"type": "result", "action": ..., "mesh": NAME, "ok": bool, "message": str,
   "rank": R, "logs": [[stream, line], ...],               (rank and logs for "logs")
   "why": str}                                              (the verdict and grouped stacks, for "why")
  {"type": "loaded"}   on a comm the kernel opens itself when the extension loads, so an open
      panel that found no monarch_kernel there links up at once (it closes that comm)
"meshes" also carries "colours": {state: CSS colour} and "glyphs": {state: symbol}, the mesh widget's.
MESH: {"name", "kind" ("local"|"ssh"|"slurm"|"ray"), "shape": {dim: size}, "hosts": [...], "dist",
       "state" ("up"|"down"), "default": bool, "allocation": str | None,
       "debugged": the rank JupyterLab's debugger stops in (None: another mesh's, or no debugger here),
       "ranks": [{"rank", "coords", "host", "local_rank", "pid", "state", "detail", "cpu", "rss",
                  "mem_total", "gpu_used", "gpu_total", "gpu_util"}, ...]}

Actions run on a helper thread, so a restart never holds up the kernel's message loop.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from monarch_kernel.views.meshview import ALLOCATION_MAX_AGE_S, STATE_COLOURS, mesh_snapshot
from monarch_kernel.views.theme import STATE_GLYPHS

from .debugger import MeshDebugger
from .registry import MeshRegistry

TARGET = "monarch_kernel.meshes"
PROTOCOL_VERSION = 1
UPDATE_INTERVAL_S = 0.5  # state changes reach the panel this fast
LOADS_INTERVAL_S = 2.0  # load and "busy for N s" changes this fast
MAX_QUEUED_ACTIONS = 16
LOAD_KEYS = ("cpu", "rss", "detail", "gpu_used", "gpu_util")  # changes sent at the loads' pace
MAX_OPEN_CHANNELS = 8  # panels that vanished without closing their comm (page reloads) are retired


def rank_changes(sent: list[dict[str, Any]] | None, meshes: list[dict[str, Any]],
                 loads: bool) -> dict[str, list[dict[str, Any]]] | None:
    """{mesh: [ranks that changed]} since `sent`, loads counted only if `loads`; None when more than
    ranks changed (a mesh came or went, its state or job line changed): then every mesh is sent."""
    if sent is None or len(sent) != len(meshes):
        return None
    changes: dict[str, list[dict[str, Any]]] = {}
    for old, new in zip(sent, meshes):
        if ({k: v for k, v in old.items() if k != "ranks"} != {k: v for k, v in new.items() if k != "ranks"}
                or [r["rank"] for r in old["ranks"]] != [r["rank"] for r in new["ranks"]]):
            return None
        changed = [n for o, n in zip(old["ranks"], new["ranks"]) if _shown(o, loads) != _shown(n, loads)]
        if changed:
            changes[new["name"]] = changed
    return changes


def _shown(rank: dict[str, Any], loads: bool) -> dict[str, Any]:
    return rank if loads else {k: v for k, v in rank.items() if k not in LOAD_KEYS}


def describe_meshes(registry: MeshRegistry, debugger: MeshDebugger | None = None) -> list[dict[str, Any]]:
    """Every mesh of the registry as plain JSON-ready data."""
    out = []
    for name in registry.names():
        mesh = registry.get(name)
        entry: dict[str, Any] = {
            "name": name, "kind": str(mesh.kind),
            "shape": mesh.shape.sizes, "hosts": mesh.hosts, "dist": mesh.backend,
            "state": "down" if mesh.closed else "up", "default": name == registry.current, "ranks": [],
            "allocation": None, "debugged": debugger.debugged_rank(name) if debugger is not None else None,
        }
        if not mesh.closed:
            entry["allocation"] = mesh.allocation_line(ALLOCATION_MAX_AGE_S)
            entry["ranks"] = [
                {"rank": c.rank, "coords": dict(c.coords), "host": c.host, "local_rank": c.local_rank, "pid": c.pid,
                 "state": str(c.state), "detail": c.detail, "cpu": c.cpu_percent, "rss": c.rss_bytes,
                 "mem_total": c.host_memory_bytes,
                 "gpu_used": c.gpu_used_bytes, "gpu_total": c.gpu_total_bytes, "gpu_util": c.gpu_util_percent}
                for c in mesh_snapshot(mesh).cells()]
        out.append(entry)
    return out


class SidebarChannel:
    """One open comm: answers requests and pushes changes.

    A browser tab that reloads never closes its comm, so a channel also ends when
    MAX_OPEN_CHANNELS newer ones have opened: two threads per live panel, not per reload.
    """

    _open: list[SidebarChannel] = []
    _open_lock = threading.Lock()

    def __init__(self, comm: Any, registry: MeshRegistry, shell: Any = None):
        self.comm = comm
        self.registry = registry
        self.shell = shell
        self._sent: list[dict[str, Any]] | None = None  # what the panel was told (its picture of the meshes)
        self._closed = threading.Event()
        if hasattr(comm, "_reply_subshell_for"):
            # ipykernel 7.4 routes a frontend's comm messages to the subshell that last published
            # on the comm; our pushes come from a helper thread, which pins requests to the main
            # shell, where they wait behind a running cell. JupyterLab sends them on a subshell
            # of their own (commsOverSubshells): keep that choice, so actions act at once.
            comm._reply_subshell_for = lambda _data, default: default
        self._actions: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=MAX_QUEUED_ACTIONS)
        comm.on_msg(self.on_msg)
        comm.on_close(lambda _msg: self._ended())
        with SidebarChannel._open_lock:
            SidebarChannel._open.append(self)
            retired = SidebarChannel._open[:-MAX_OPEN_CHANNELS]
            del SidebarChannel._open[:-MAX_OPEN_CHANNELS]
        for old in retired:
            old.retire()
        self.push(force=True)
        threading.Thread(target=self._follow, name="mesh-sidebar", daemon=True).start()
        threading.Thread(target=self._work, name="mesh-sidebar-actions", daemon=True).start()

    def _ended(self) -> None:
        self._closed.set()
        with SidebarChannel._open_lock:
            if self in SidebarChannel._open:
                SidebarChannel._open.remove(self)

    def retire(self) -> None:
        """Stop following and close the comm (a newer panel took over)."""
        self._closed.set()
        try:
            self.comm.close()
        except Exception:  # noqa: BLE001 - the frontend is long gone
            pass

    def push(self, force: bool = False, loads: bool = False) -> None:
        """Send what changed since the last message (or everything, if forced): only the ranks that
        changed while the meshes are the same ones, else every mesh; with `loads`, changes of load
        and busy detail count too (they change all the time: news every LOADS_INTERVAL_S)."""
        meshes = describe_meshes(self.registry, self._debugger())
        changes = None if force else rank_changes(self._sent, meshes, loads)
        if changes == {}:
            return
        if changes is None:
            self._sent = meshes
            self.comm.send({"type": "meshes", "version": PROTOCOL_VERSION, "meshes": meshes,
                            "colours": STATE_COLOURS, "glyphs": STATE_GLYPHS})
            return
        for mesh in self._sent or []:
            changed = {r["rank"]: r for r in changes.get(mesh["name"], [])}
            mesh["ranks"] = [changed.get(r["rank"], r) for r in mesh["ranks"]]
        self.comm.send({"type": "ranks", "version": PROTOCOL_VERSION, "changes": changes})

    def on_msg(self, msg: dict[str, Any]) -> None:
        """Handle one request from the frontend (anything malformed gets an error reply)."""
        data = msg.get("content", {}).get("data") if isinstance(msg, dict) else None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "refresh":
            self.push(force=True)
        elif kind == "action" and isinstance(data, dict):
            try:  # one worker per panel, in order: a burst of clicks starts no thread storm
                self._actions.put_nowait(data)
            except queue.Full:
                self.comm.send({"type": "result", "ok": False, "action": data.get("action"),
                                "message": "too many actions are waiting; try again when they are done"})
        else:
            shown = kind if kind is not None else type(data).__name__
            self.comm.send({"type": "result", "ok": False, "message": f"unknown request {shown!r}"})

    def _work(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._actions.get(timeout=UPDATE_INTERVAL_S)
            except queue.Empty:
                continue
            self._act(data)

    def _act(self, data: dict[str, Any]) -> None:
        action, name = data.get("action"), data.get("mesh")
        reply: dict[str, Any] = {"type": "result", "action": action, "mesh": name, "ok": True, "message": ""}
        try:
            mesh = self.registry.get(name)
            if action == "interrupt":
                mesh.interrupt()
                reply["message"] = f"interrupted mesh {name!r}"
            elif action == "restart":
                mesh.restart()
                reply["message"] = f"mesh {name!r} restarted"
            elif action == "down":
                self.registry.remove(mesh.name).shutdown()
                reply["message"] = f"mesh {name!r} is down"
            elif action == "why":
                diagnosis = mesh.why()
                reply["why"] = diagnosis.text()
                reply["message"] = str(diagnosis.verdict).splitlines()[0]
            elif action == "debug":
                debugger = self._debugger()
                if debugger is None:
                    raise ValueError("this kernel has no debugger (JupyterLab's needs ipykernel 6+ with debugpy)")
                reply["rank"] = int(data["rank"])
                reply["message"] = debugger.choose(mesh, reply["rank"])
            elif action == "logs":
                rank = reply["rank"] = int(data["rank"])
                reply["logs"] = [[stream, line] for stream, line in mesh.logs(rank, int(data.get("lines", 30)))]
                reply["message"] = f"last lines of rank {rank}"
            else:
                reply.update(ok=False, message=f"unknown action {action!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the panel, never raised in the kernel
            reply.update(ok=False, message=str(exc) or type(exc).__name__)
        self.comm.send(reply)
        self.push(force=True)

    def _debugger(self) -> MeshDebugger | None:
        debugger = getattr(getattr(self.shell, "kernel", None), "debugger", None)
        return debugger if isinstance(debugger, MeshDebugger) else None

    def _follow(self) -> None:
        ticks = 0
        while not self._closed.wait(UPDATE_INTERVAL_S) and not getattr(self.comm, "_closed", False):
            ticks += 1
            try:
                self.push(loads=ticks % round(LOADS_INTERVAL_S / UPDATE_INTERVAL_S) == 0)
            except Exception:  # noqa: BLE001 - the comm went away with its kernel
                return


def register(shell: Any, registry: MeshRegistry) -> bool:
    """Register the comm target in a kernel (no-op elsewhere); True if registered."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False
    from comm import get_comm_manager

    def opened(comm: Any, _msg: dict[str, Any]) -> None:
        SidebarChannel(comm, registry, shell)  # it keeps itself alive through the comm's callbacks

    get_comm_manager().register_target(TARGET, opened)
    return True


def announce(shell: Any) -> None:
    """Tell frontends of this kernel that the extension just loaded (no-op outside a kernel).

    A frontend without the sidebar closes the comm (or ignores it); the sidebar closes it too,
    then opens its own to the registered target.
    """
    if getattr(shell, "kernel", None) is None:
        return
    from comm import create_comm

    try:
        comm = create_comm(target_name=TARGET, data={"type": "loaded"})
        comm.on_msg(lambda _msg: None)
    except Exception:  # noqa: BLE001 - no frontend to tell
        pass


def unregister(shell: Any) -> None:
    """Remove the comm target (on %unload_ext)."""
    if getattr(shell, "kernel", None) is None:
        return
    from comm import get_comm_manager

    try:
        get_comm_manager().unregister_target(TARGET, None)  # type: ignore[arg-type]  # the name is what counts
    except Exception:  # noqa: BLE001 - never registered
        pass
