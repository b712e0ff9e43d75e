"""Meshes that outlive the kernel, for the notebook and the terminal: check a new one's settings,
list them, attach to one, stop one.

>>> mesh = local_mesh(4, name="train", persist="8h")   # kernel restarts, ranks stay
>>> mesh = monarch_kernel.attach("train")              # in the next kernel: same pids, same variables
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from monarch_kernel.api.futures import MeshFuture
from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.sinks import IdleOutput, default_sink, report_timing
from monarch_kernel.controller.agent_reach import MeshAttachError, ask_now
from monarch_kernel.controller.persistence import PersistentRuntime
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.mesh_records import (
    MeshRecord,
    RecordError,
    format_duration,
    list_names,
    read_record,
    remove_record,
)
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.shape import Shape
from monarch_kernel.core.status import RankStatus
from monarch_kernel.wire import persist_messages as pm


@dataclass(frozen=True)
class PersistentMesh:
    """One persistent mesh as a listing shows it."""

    name: str
    kind: str
    shape: str
    hosts: list[str]
    age_s: float
    running: bool  # its agent answered
    holder: pm.Holder | None  # the kernel that holds it, if one does
    idle_s: float  # seconds without a kernel
    expires_in_s: float | None  # ... left before it stops itself (None while held)
    busy: str  # what its ranks run now ("" when idle)
    problem: str = ""  # why it could not be asked (not running, unsafe record)

    def line(self) -> str:
        """One line: name, kind, shape, hosts, age, idle for, running cell, holder."""
        if not self.running:
            return f"{self.name}: {self.problem}"
        held = (f"held by pid {self.holder.pid}" + (f" ({self.holder.notebook})" if self.holder.notebook else "")
                if self.holder else f"no kernel for {format_duration(self.idle_s)}, stops in "
                                    f"{format_duration(self.expires_in_s or 0)}")
        return (f"{self.name}: {self.kind} {self.shape} on {', '.join(self.hosts)}, up {format_duration(self.age_s)}, "
                f"{held}" + (f", running {self.busy}" if self.busy else ", idle"))


def persistent_meshes() -> list[PersistentMesh]:
    """This user's persistent meshes on this machine, each asked how it is."""
    found = []
    for name in list_names():
        try:
            record = read_record(name)
        except RecordError as exc:
            found.append(PersistentMesh(name, "?", "?", [], 0.0, False, None, 0.0, None, "", str(exc)))
            continue
        try:
            info = ask_now(record, pm.MeshQuery())
        except MeshAttachError as exc:
            info, problem = None, str(exc)
        else:
            problem = "" if info is not None else f"not running: its agent (pid {record.agent_pid}) is gone"
        busy = ", ".join(sorted({r.running_label or r.activity.rsplit(" ", 1)[0] for r in info.ranks
                                 if r.running_label or r.activity})) if info else ""
        found.append(PersistentMesh(name, record.kind, record.shape, record.hosts, time.time() - record.created,
                                    info is not None, info.holder if info else None, info.idle_for if info else 0.0,
                                    info.expires_in if info else None, busy, problem))
    return found


def stop_persistent(name: str) -> str:
    """Stop a persistent mesh now (from any kernel or a terminal); what happened, in words."""
    record = read_record(name)
    try:
        stopped = ask_now(record, pm.StopMesh()) is not None
    except MeshAttachError:
        stopped = False
    remove_record(name, record.agent_pid)  # (the agent removes it too; a stale one goes here)
    return f"mesh {name!r} stopped" if stopped else f"mesh {name!r} was not running; its record was removed"


def attach(name: str, *, take: bool = False) -> Mesh:
    """Attach to persistent mesh `name`: the same ranks, namespaces, actors and process groups; what ran while
    no kernel held it is shown. Refused while another live kernel holds it, unless `take=True`."""
    try:
        record = read_record(name)
        runtime = PersistentRuntime.attach(record, take, idle_output=IdleOutput(label=f"mesh {name!r}"),
                                             report_timing=report_timing)
    except (RecordError, MeshAttachError) as exc:
        raise MeshUsageError(str(exc)) from None
    mesh = Mesh(runtime, Shape.grid(hosts=len(runtime.spec.hosts), gpus=runtime.spec.gpus))
    show_detached(mesh, record)
    return mesh


def show_detached(mesh: Mesh, record: MeshRecord) -> None:
    """Say what was attached, and show what ran meanwhile, grouped across ranks as a cell's output is."""
    runtime = mesh._runtime
    assert isinstance(runtime, PersistentRuntime)
    alive = [s for s in mesh.status() if s.pid is not None and s.state != RankStatus.DEAD]
    print(f"attached to mesh {mesh.name!r} {mesh.shape}: {len(alive)} of {len(mesh.ranks)} ranks running "
          f"(pids {', '.join(str(s.pid) for s in alive)}); no kernel held it for {format_duration(runtime.detached_for)}")
    for run in runtime.detached_runs:  # those still running: followed to their end, here, as a --bg cell is
        if run.request is not None and run.req_id not in runtime.detached_futures:
            part = mesh.select_ranks(sorted(run.request.ranks))
            runtime.detached_futures[run.req_id] = MeshFuture(
                runtime, run.request, default_sink(ranks=part.ranks, label=run.label, background=True), part._values)
    for result in mesh.detached_results:
        sink = default_sink(ranks=result.ranks, dedupe=True, label=f"{result.label} (while no kernel was attached)")
        for rank, text in result.output.items():
            sink.output(rank, "stdout", text)
        for rank, error in result.errors.items():
            sink.notice(rank, error)
        for rank in result.ranks:
            sink.rank_done(rank)
        sink.close()
        if result.future is not None and result.running:
            print(f"{result.label} still runs on ranks {format_ranks(result.running)}: what it prints comes here; "
                  f"its values: mesh.detached_results[...].future.get()")
            result.future.pump_in_background()
            continue
        values = _grouped({rank: repr(value) for rank, value in result.values.items()})
        print(f"{result.label} ran to its end while no kernel was attached: "
              + ("; ".join(f"ranks {ranks}: {text}" for text, ranks in values) or "no values")
              + (f"; failed on ranks {format_ranks(sorted(result.errors))}" if result.errors else ""))


def _grouped(by_rank: dict[int, str]) -> list[tuple[str, str]]:
    texts: dict[str, list[int]] = {}
    for rank, text in by_rank.items():
        texts.setdefault(text if len(text) < 200 else text[:197] + "...", []).append(rank)
    return [(text, format_ranks(ranks)) for text, ranks in texts.items()]
