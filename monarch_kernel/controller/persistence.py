"""Meshes that outlive their kernel, on the controller's side: persist, leave, attach, take over.

A `PersistentRuntime` starts like any mesh, then tells its agent to outlive the kernel (`Persist`)
and writes the mesh's record (`core/mesh_records`). When the kernel ends, the mesh is left, not shut
down: the link closes and the agent keeps the ranks. A later kernel attaches: it reaches the agent's
Unix socket (served by the recorded agent pid, as our own user), proves the mesh's secret, and gets
the ranks' state and what they said meanwhile (`Attached`). Only local meshes persist for now.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from monarch_kernel.controller.hosts import HostConnection, HostSpec
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.rank_start import quiet_future
from monarch_kernel.controller.runtime import MeshRuntime, settle
from monarch_kernel.controller.state import HostLink, MeshSpec, RankState
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.folders import forget_folder
from monarch_kernel.core.mesh_records import MeshRecord, RecordError, format_duration, record_path, write_record
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import persist_messages as pm
from monarch_kernel.wire.calls import unregister_sender
from monarch_kernel.wire.direct_auth import AuthenticationFailed, new_secret, prove_controller_async
from monarch_kernel.wire.lanes import peer_credentials
from monarch_kernel.wire.relay_link import DOWN, RelayLink
from monarch_kernel.wire.serialization import unseal

ATTACH_TIMEOUT_S = 10.0
SOCKET_NAME = "agent.sock"


class MeshAttachError(RuntimeError):
    """A persistent mesh cannot be attached (held by another kernel, gone, or not proved)."""


@dataclass
class DetachedRun:
    """What one request did while no kernel held the mesh: each rank's output and result."""

    req_id: int
    label: str
    output: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # rank -> (stream, text)
    results: dict[int, m.Result] = field(default_factory=dict)


@dataclass(frozen=True)
class DetachedResult:
    """A request that ran to its end while no kernel held the mesh: its label ("In[4]"), each rank's
    output (text), value and error (formatted)."""

    label: str
    ranks: tuple[int, ...]
    output: dict[int, str]
    values: dict[int, Any]
    errors: dict[int, str]

    def __repr__(self) -> str:
        return (f"<DetachedResult {self.label}: ranks {list(self.ranks)}, values {self.values}"
                + (f", errors on ranks {sorted(self.errors)}" if self.errors else "") + ">")


def this_holder() -> pm.Holder:
    """This kernel as a holder of meshes: pid, notebook (as Jupyter names it, when it does), now."""
    return pm.Holder(os.getpid(), os.environ.get("JPY_SESSION_NAME", ""), time.time())


class PersistentRuntime(MeshRuntime):
    """A mesh that outlives its kernel for `spec.persist_s` seconds without one."""

    def __init__(self, spec: MeshSpec, **options: Any):
        super().__init__(spec, **options)
        self._ready: asyncio.Future[Any] | None = None
        self._attached: asyncio.Future[Any] | None = None
        self.detached_runs: list[DetachedRun] = []  # what the ranks did while no kernel held the mesh
        self.detached_for = 0.0
        self.record: MeshRecord | None = None
        self._handlers.update({
            pm.PersistReady: lambda link, msg: settle(self._ready, msg),
            pm.Attached: lambda link, msg: settle(self._attached, msg),
            pm.AttachRefused: lambda link, msg: settle(self._attached, msg),
            pm.TakenOver: lambda link, msg: self._taken_over(msg.holder),
        })

    # ------------------------------------------------------------ the first kernel
    def start(self, timeout: float | None = None) -> None:
        """Start the mesh, then have its agent outlive this kernel; the record is written last."""
        super().start(timeout)
        self.record = self.controller.run(self._persist()).result(ATTACH_TIMEOUT_S + 5)

    async def _persist(self) -> MeshRecord:
        link = self.state.links[0]
        secret = new_secret()
        path = os.path.join(self.state.run_dir, SOCKET_NAME)
        self._ready = asyncio.get_running_loop().create_future()
        link.send(pm.Persist(self.spec.persist_s or 0.0, path, secret, record_path(self.name), this_holder()))
        try:
            ready = await asyncio.wait_for(self._ready, ATTACH_TIMEOUT_S)
        except TimeoutError:
            raise MeshStartError(f"mesh {self.name!r}: its agent did not say it would outlive the kernel; "
                                 f"see {link.log_path}") from None
        record = MeshRecord(self.name, "local", [h.name for h in self.spec.hosts], self.spec.gpus, self.spec.backend,
                            self.spec.persist_s or 0.0, time.time(), ready.pid, path, secret.hex(),
                            self.state.run_dir, self.state.shm_dir, spec_fields(self.spec))
        write_record(record)
        return record

    def detached_results(self) -> list[DetachedResult]:
        """What ran to its end while no kernel held the mesh (values unsealed here, on each call)."""
        found = []
        for run in self.detached_runs:
            values = {rank: unseal(r.value) if r.value is not None else None
                      for rank, r in sorted(run.results.items()) if r.failure is None}
            errors = {rank: r.failure.traceback or f"{r.failure.error_type}: {r.failure.message}"
                      for rank, r in sorted(run.results.items()) if r.failure is not None}
            output = {rank: "".join(text for _, text in parts) for rank, parts in sorted(run.output.items())}
            found.append(DetachedResult(run.label, tuple(sorted(set(run.results) | set(run.output))), output,
                                        values, errors))
        return found

    # ------------------------------------------------------------ leaving, taken over
    def leave(self) -> None:
        """The kernel ends: the mesh stays for the next one (its ranks, their state, its folders)."""
        self._let_go(f"mesh {self.name!r} was left running for the next kernel: attach it with "
                     f"%mesh attach {self.name} (or monarch_kernel.attach({self.name!r}))")

    def _taken_over(self, holder: pm.Holder) -> None:
        where = f" ({holder.notebook})" if holder.notebook else ""
        why = f"mesh {self.name!r} was taken over by pid {holder.pid}{where}; attach it again with --take to take it back"
        threading.Thread(target=self._let_go, args=(why,), name="mesh-taken-over", daemon=True).start()

    def _let_go(self, why: str) -> None:
        if self.state.closed:
            return
        self.state.closed, self.state.closed_why = True, why
        unregister_sender(self.name, self.sender)
        self.requests.fail_all(why)
        self.controller.run(self._drop_links()).result(5)
        for folder in (self.state.run_dir, self.state.shm_dir):
            forget_folder(folder)

    async def _drop_links(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for link in self.state.links:
            link.close()  # (no Shutdown: the agent keeps the ranks)

    # ------------------------------------------------------------ a later kernel
    @classmethod
    def attach(cls, record: MeshRecord, take: bool, **options: Any) -> PersistentRuntime:
        """Attach to the mesh of `record` (raises MeshAttachError saying why not)."""
        runtime = cls(spec_of(record), folders=(record.run_dir, record.shm_dir), **options)
        runtime.record = record
        try:
            runtime.controller.run(runtime._attach(record, take)).result(ATTACH_TIMEOUT_S + 5)
        except BaseException:
            runtime._let_go(f"mesh {record.name!r} is not attached")
            raise
        return runtime

    async def _attach(self, record: MeshRecord, take: bool) -> None:
        loop = asyncio.get_running_loop()
        host = self.spec.hosts[0].name
        ranks = list(range(record.gpus))
        link = HostLink(0, host, ranks, log_path=os.path.join(record.run_dir, "agent-0.log"),
                        greeted=quiet_future(loop), host=HostConnection(None, "127.0.0.1", local_pid=record.agent_pid))
        self.state.links = [link]
        self.state.ranks = {rank: RankState(rank, host, rank) for rank in ranks}
        reader, writer, session = await open_agent(record)
        self._attached = loop.create_future()
        link.conn = RelayLink(reader, writer, session, DOWN, partial(self._on_message, link), partial(self._on_lost, link))
        link.send(pm.AttachRequest(this_holder(), take))
        answer = await asyncio.wait_for(self._attached, ATTACH_TIMEOUT_S)
        if isinstance(answer, pm.AttachRefused):
            held = answer.holder
            where = f", notebook {held.notebook}" if held.notebook else ""
            raise MeshAttachError(f"mesh {record.name!r} is held by another kernel (pid {held.pid}{where}, since "
                                  f"{time.strftime('%H:%M:%S', time.localtime(held.since))}); attach with --take "
                                  f"(take=True) to move it here")
        self._took(answer)
        self._heartbeat = loop.create_task(self.hearing.ping_hosts())

    def _took(self, attached: pm.Attached) -> None:
        for info in attached.ranks:
            state = self.state.ranks[info.rank]
            state.fd_seen = info.fd_total
            if info.alive:
                state.started(info.pid)
            else:
                state.pid, state.alive = info.pid or None, False
        self.detached_for = attached.detached_for
        runs: dict[int, DetachedRun] = {}
        for msg in attached.held:
            self._keep(msg, runs, attached.labels)
        self.detached_runs = list(runs.values())

    def _keep(self, msg: Any, runs: dict[int, DetachedRun], labels: dict[int, str]) -> None:
        def run_of(req_id: int) -> DetachedRun:
            return runs.setdefault(req_id, DetachedRun(req_id, labels.get(req_id) or f"request {req_id}"))

        if isinstance(msg, m.Output) and msg.text:
            self.state.ranks[msg.rank].log.write(msg.stream, msg.text)  # (%mesh logs shows it)
            if msg.req_id is not None:
                run_of(msg.req_id).output.setdefault(msg.rank, []).append((msg.stream, msg.text))
        elif isinstance(msg, m.Gathered):
            for result in msg.results:
                run_of(result.req_id).results[result.rank] = result
        elif isinstance(msg, m.RankExited):
            state = self.state.ranks[msg.rank]
            state.exit_code, state.signal = msg.exit_code, msg.signal


class MeshGone(MeshAttachError):
    """The recorded agent does not answer: the mesh ended (or was killed) and left its record."""


async def open_agent(record: MeshRecord) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """Reach a persistent mesh's agent: its socket, served by the recorded pid as our own user, and the
    mutual proof of the secret; (reader, writer, session key). Raises MeshAttachError saying why not."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(record.socket, limit=1 << 22),
                                                ATTACH_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise MeshGone(f"mesh {record.name!r} is not running: its agent (pid {record.agent_pid}) does not answer "
                       f"at {record.socket} ({type(exc).__name__}); `python -m monarch_kernel meshes stop "
                       f"{record.name}` removes its record") from None
    pid, uid = peer_credentials(writer.get_extra_info("socket"))
    if uid != os.getuid() or pid != record.agent_pid:
        writer.close()
        raise MeshAttachError(f"the socket of mesh {record.name!r} is served by pid {pid} (uid {uid}), not by its "
                              f"agent (pid {record.agent_pid}): refusing a stale or forged record")
    try:
        session = await prove_controller_async(reader, writer, bytes.fromhex(record.secret))
    except (AuthenticationFailed, ValueError) as exc:
        writer.close()
        raise MeshAttachError(f"mesh {record.name!r}: its agent did not accept this record's secret ({exc}): "
                              "the record is stale or forged") from None
    return reader, writer, session


async def ask_agent(record: MeshRecord, request: pm.MeshQuery | pm.StopMesh,
                    timeout: float = ATTACH_TIMEOUT_S) -> pm.MeshInfo:
    """One question to a persistent mesh's agent (how is it; stop); its answer."""
    reader, writer, session = await open_agent(record)
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def closed(exc: Exception | None) -> None:
        if not answer.done():
            answer.set_exception(MeshGone(f"mesh {record.name!r}: its agent closed the link ({exc})"))

    link = RelayLink(reader, writer, session, DOWN, lambda msg: settle(answer, msg), closed)
    link.send(request)
    try:
        return await asyncio.wait_for(answer, timeout)
    finally:
        link.close()


def ask_now(record: MeshRecord, request: pm.MeshQuery | pm.StopMesh) -> pm.MeshInfo | None:
    """`ask_agent` from any thread but the controller's: the answer, or None if the agent is gone (raises
    MeshAttachError for a record the agent refuses)."""
    try:
        return ControllerLoop.get().run(ask_agent(record, request)).result(ATTACH_TIMEOUT_S + 2)
    except MeshGone:
        return None


def spec_fields(spec: MeshSpec) -> dict[str, Any]:
    """What a record keeps of a mesh's settings, beyond its shape."""
    return {"env": spec.env, "preload": list(spec.preload), "health": dataclasses.asdict(spec.health),
            "start_timeout_s": spec.start_timeout_s}


def spec_of(record: MeshRecord) -> MeshSpec:
    """The MeshSpec of a recorded mesh."""
    try:
        saved = record.spec
        return MeshSpec(record.name, tuple(HostSpec(h) for h in record.hosts), record.gpus, record.dist,
                        dict(saved.get("env", {})), None, float(saved.get("start_timeout_s", 120.0)),
                        m.HealthTimings(**saved.get("health", {})), preload=(), persist_s=record.persist_s)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"the record of mesh {record.name!r} has settings this version cannot read ({exc})") from None


def describe_age(record: MeshRecord) -> str:
    """How long ago the mesh started."""
    return format_duration(time.time() - record.created)

