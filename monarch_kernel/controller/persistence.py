"""Meshes that outlive their kernel, on the controller's side: persist, leave, attach, take over.

A `PersistentRuntime` starts like any mesh, then tells its agent to outlive the kernel (`Persist`)
and writes the mesh's record (`core/mesh_records`). When the kernel ends, the mesh is left, not shut
down: the link closes and the agent keeps the ranks. A later kernel attaches: it reaches the agent's
Unix socket (served by the recorded agent pid, as our own user), or its port on a Slurm or Ray node,
proves the mesh's secret, and gets the ranks' state and what they said meanwhile (`Attached`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from monarch_kernel.controller.agent_reach import (
    ATTACH_TIMEOUT_S,
    MeshAttachError,
    agents_of,
    reach_agent,
    spec_fields,
    spec_of,
    stop_agents,
)
from monarch_kernel.controller.hosts import HostConnection, HostKind, HostSpec
from monarch_kernel.controller.rank_start import quiet_future
from monarch_kernel.controller.ray_detached import ray_names
from monarch_kernel.controller.runtime import MeshRuntime, settle
from monarch_kernel.controller.slurm_step import SlurmStep, StepLink
from monarch_kernel.controller.state import HostLink, MeshSpec, RankState
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.folders import forget_folder
from monarch_kernel.core.mesh_records import MeshRecord, format_duration, record_path, remove_record, write_record
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import persist_messages as pm
from monarch_kernel.wire.calls import unregister_sender
from monarch_kernel.wire.direct_auth import new_secret
from monarch_kernel.wire.relay_link import DOWN, RelayLink
from monarch_kernel.wire.serialization import unseal

SOCKET_NAME = "agent.sock"


@dataclass
class DetachedRun:
    """What one request did while no kernel held the mesh: each rank's output and result."""

    req_id: int
    label: str
    output: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # rank -> (stream, text)
    results: dict[int, m.Result] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)  # ranks that still ran it when this kernel attached
    request: Any = None  # then: the controller's Request that follows it to its end


@dataclass(frozen=True)
class DetachedResult:
    """A request an earlier kernel sent, as this kernel found it: its label ("In[4]"), each rank's output
    (text), value and error (formatted) from while no kernel held the mesh. If it still ran on some ranks
    (`running`), `future` follows it to its end (a MeshFuture: `.get()` gives every rank's value)."""

    label: str
    ranks: tuple[int, ...]
    output: dict[int, str]
    values: dict[int, Any]
    errors: dict[int, str]
    running: tuple[int, ...] = ()
    future: Any = None

    def __repr__(self) -> str:
        return (f"<DetachedResult {self.label}: ranks {list(self.ranks)}, values {self.values}"
                + (f", errors on ranks {sorted(self.errors)}" if self.errors else "") + ">")


def this_holder() -> pm.Holder:
    """This kernel as a holder of meshes: pid, notebook (as Jupyter names it, when it does), now."""
    return pm.Holder(os.getpid(), os.environ.get("JPY_SESSION_NAME", ""), time.time())


_NO_RUN = DetachedRun(-1, "")


class PersistentRuntime(MeshRuntime):
    """A mesh that outlives its kernel for `spec.persist_s` seconds without one."""

    def __init__(self, spec: MeshSpec, **options: Any):
        super().__init__(spec, **options)
        self._ready: dict[int, asyncio.Future[Any]] = {}  # by host: its agent listens (PersistReady)
        self._attached: dict[int, asyncio.Future[Any]] = {}  # by host: Attached or AttachRefused
        self._held_batches: dict[int, list[Any]] = {}  # by host: what came in HeldBatch frames before Attached
        self.state.persistent = True
        self.detached_runs: list[DetachedRun] = []  # what the ranks did while no kernel held the mesh
        self.detached_for = 0.0
        self.detached_futures: dict[int, Any] = {}  # req_id -> the notebook's future on a request still running
        self.record: MeshRecord | None = None
        self._handlers.update({
            pm.PersistReady: lambda link, msg: settle(self._ready.get(link.index), msg),
            pm.HeldBatch: lambda link, msg: self._held_batches.setdefault(link.index, []).extend(msg.held),
            pm.Attached: self._on_attached,
            pm.AttachRefused: lambda link, msg: settle(self._attached.get(link.index), msg),
            pm.TakenOver: lambda link, msg: self._taken_over(msg.holder),
        })

    # ------------------------------------------------------------ the first kernel
    async def _start(self) -> None:
        """Start (or restart on new agents), then have every agent outlive this kernel: the record is written
        (anew, naming the new agents) before the agents are told it exists (`PersistRecorded`)."""
        await super()._start()
        previous = self.record
        self.record = await self._persist()
        for link in self.state.links:
            link.send(pm.PersistRecorded())
        if previous is not None and previous.agent_pid != self.record.agent_pid:
            await self._stop_replaced(previous)

    async def _stop_replaced(self, previous: MeshRecord) -> None:
        """A restart on new agents: ask the agents the old record named to stop (one cut off from us keeps its
        ranks until it hears; say so)."""
        assert self.record is not None
        reused = {(a["host"], a["socket"]) for a in agents_of(self.record)}  # (a local agent's socket: the new one's)
        old = [a for a in agents_of(previous) if (a["host"], a["socket"]) not in reused]
        if not old:
            return
        try:
            missed = await asyncio.wait_for(stop_agents(dataclasses.replace(previous, agents=old)), ATTACH_TIMEOUT_S * 2)
        except TimeoutError:
            missed = [a["host"] for a in old]
        if missed:
            print(f"monarch_kernel: mesh {self.name!r} restarted on new agents; the old agents on {', '.join(missed)} "
                  f"could not be told to stop: each keeps its ranks until it hears from a kernel or its persist "
                  f"time ({format_duration(previous.persist_s)} without a kernel) runs out", file=sys.stderr, flush=True)

    async def _persist(self) -> MeshRecord:
        secret = new_secret()
        loop = asyncio.get_running_loop()
        record_file = record_path(self.name)
        for link, spec in zip(self.state.links, self.spec.hosts):
            local = link.host is not None and link.host.is_local
            self._ready[link.index] = loop.create_future()
            link.send(pm.Persist(self.spec.persist_s or 0.0, self._listen_at(link, spec), secret,
                                 record_file if local else "", this_holder()))
        try:
            ready = await asyncio.wait_for(asyncio.gather(*self._ready.values()), ATTACH_TIMEOUT_S)
        except TimeoutError:
            raise MeshStartError(f"mesh {self.name!r}: its agents did not say they would outlive the kernel; "
                                 f"see the agent logs in {self.state.run_dir}") from None
        ray_held = ray_names(self.spec.allocation)
        agents = [{"host": spec.name, "kind": str(spec.kind), "socket": answer.socket, "pid": answer.pid}
                  | ({"target": spec.target or spec.name, "options": spec.options,
                      "connect_timeout_s": spec.connect_timeout_s} if spec.kind == HostKind.SSH else {})
                  | ({"target": spec.target or spec.name, "job": spec.options["job"],
                      "address": spec.options["address"]} if spec.kind == HostKind.SLURM else {})
                  | ({"target": spec.target or spec.name, "address": spec.options["address"]} | ray_held[index]
                     if spec.kind == HostKind.RAY else {})
                  for index, (spec, answer) in enumerate(zip(self.spec.hosts, ready))]
        kind = next((k for k in (HostKind.SLURM, HostKind.RAY, HostKind.SSH) if any(h.kind == k for h in self.spec.hosts)),
                    HostKind.LOCAL)
        record = MeshRecord(self.name, str(kind), [h.name for h in self.spec.hosts], self.spec.gpus, self.spec.backend,
                            self.spec.persist_s or 0.0, time.time(), ready[0].pid, ready[0].socket, secret.hex(),
                            self.state.run_dir, self.state.shm_dir, spec_fields(self.spec), agents=agents)
        write_record(record)
        return record

    def _listen_at(self, link: HostLink, spec: HostSpec) -> str:
        """Where a host's agent waits for the next kernel: the mesh's folder here, a folder of its own on an
        SSH host, a TCP port on a Slurm or Ray node's address (the direct link's kind: the secret's proof decides)."""
        if link.host is not None and link.host.is_local:
            return os.path.join(self.state.run_dir, SOCKET_NAME)
        if spec.kind == HostKind.RAY:  # (its link is already a direct one to the node's address)
            return f"tcp:{spec.options['address']}"
        if spec.kind != HostKind.SLURM:
            return ""
        step = link.host.remote if link.host is not None else None
        if not isinstance(step, SlurmStep) or step.channel != StepLink.DIRECT:
            raise MeshStartError(f"mesh {self.name!r}: persist on Slurm needs the direct link to the nodes, and node "
                                 f"{spec.name} has none (see its agent log); start without --no-direct, or without persist")
        return f"tcp:{spec.options['address']}"

    def detached_results(self) -> list[DetachedResult]:
        """What ran to its end while no kernel held the mesh (values unsealed here, on each call)."""
        found = []
        for run in self.detached_runs:
            values = {rank: unseal(r.value) if r.value is not None else None
                      for rank, r in sorted(run.results.items()) if r.failure is None}
            errors = {rank: r.failure.traceback or f"{r.failure.error_type}: {r.failure.message}"
                      for rank, r in sorted(run.results.items()) if r.failure is not None}
            output = {rank: "".join(text for _, text in parts) for rank, parts in sorted(run.output.items())}
            ranks = tuple(sorted(set(run.results) | set(run.output) | run.running))
            found.append(DetachedResult(run.label, ranks, output, values, errors, tuple(sorted(run.running)),
                                        self.detached_futures.get(run.req_id)))
        return found

    def _end_lost_host(self, link: HostLink) -> None:
        """A lost link to a persistent mesh's agent is a detach, never a kill: the agent keeps the ranks and
        what they say for the next kernel (a stall, a refused frame or a take-over race must not end them)."""

    # ------------------------------------------------------------ leaving, taken over
    def shutdown(self) -> None:
        """Stop the mesh for good: every rank and agent ends, and its record goes."""
        was_open = not self.state.closed
        super().shutdown()
        if was_open and self.record is not None:
            remove_record(self.name, self.record.agent_pid)

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
            if link.host is not None and link.host.remote is not None:
                link.host.remote.let_go()  # our SSH connection or srun pipes (the agent waits for the next kernel)

    # ------------------------------------------------------------ a later kernel
    @classmethod
    def attach(cls, record: MeshRecord, take: bool, **options: Any) -> PersistentRuntime:
        """Attach to the mesh of `record` (raises MeshAttachError saying why not)."""
        local = record.kind == HostKind.LOCAL  # (its folders are still there; an SSH mesh's were the old kernel's)
        runtime = cls(spec_of(record), folders=(record.run_dir, record.shm_dir) if local else None, **options)
        runtime.record = record
        try:
            runtime.controller.run(runtime._attach(record, take)).result(ATTACH_TIMEOUT_S * 2 + 5)
        except BaseException:
            runtime._let_go(f"mesh {record.name!r} is not attached")
            raise
        return runtime

    async def _attach(self, record: MeshRecord, take: bool) -> None:
        loop = asyncio.get_running_loop()
        gpus = record.gpus
        for index, spec in enumerate(self.spec.hosts):
            ranks = list(range(index * gpus, (index + 1) * gpus))
            self.state.links.append(HostLink(index, spec.name, ranks, greeted=quiet_future(loop),
                                             log_path=os.path.join(self.state.run_dir, f"agent-{index}.log")))
            for local, rank in enumerate(ranks):
                self.state.ranks[rank] = RankState(rank, spec.name, local)
        answers = await asyncio.gather(*(self._attach_host(record, link, take) for link in self.state.links),
                                       return_exceptions=True)
        problem = next((a for a in answers if isinstance(a, BaseException)), None)
        if problem is not None:
            raise problem
        refused = next((a for a in answers if isinstance(a, pm.AttachRefused)), None)
        if refused is not None:
            held = refused.holder
            where = f", notebook {held.notebook}" if held.notebook else ""
            raise MeshAttachError(f"mesh {record.name!r} is held by another kernel (pid {held.pid}{where}, since "
                                  f"{time.strftime('%H:%M:%S', time.localtime(held.since))}); attach with --take "
                                  f"(take=True) to move it here")
        self._heartbeat = loop.create_task(self.hearing.ping_hosts())

    async def _attach_host(self, record: MeshRecord, link: HostLink, take: bool) -> Any:
        reached = await reach_agent(record, link.index, self.state.run_dir)
        agent = agents_of(record)[link.index]
        address = agent.get("address") or (reached.forwarded.peer_address if reached.forwarded is not None
                                           else "127.0.0.1")
        link.host = HostConnection(None, address, remote=reached.forwarded,
                                   local_pid=None if reached.forwarded is not None else agent["pid"])
        self._attached[link.index] = asyncio.get_running_loop().create_future()
        link.conn = RelayLink(reached.reader, reached.writer, reached.session, DOWN, partial(self._on_message, link),
                              partial(self._on_lost, link))
        link.send(pm.AttachRequest(this_holder(), take))
        return await asyncio.wait_for(self._attached[link.index], ATTACH_TIMEOUT_S)

    def _on_attached(self, link: HostLink, attached: pm.Attached) -> None:
        """As it arrives (before any later message of that host): the ranks, and what they did meanwhile."""
        earlier = self._held_batches.pop(link.index, [])
        if earlier:
            attached = dataclasses.replace(attached, held=(*earlier, *attached.held))
        self._took(attached)
        settle(self._attached.get(link.index), attached)

    def _took(self, attached: pm.Attached) -> None:
        for info in attached.ranks:
            state = self.state.ranks[info.rank]
            state.fd_seen = info.fd_total
            if info.alive:
                state.started(info.pid)
            else:
                state.pid, state.alive = info.pid, False  # (its pid, if a held RankExited says it: _keep)
        self.detached_for = max(self.detached_for, attached.detached_for)
        runs = {run.req_id: run for run in self.detached_runs}  # (one request's ranks may be on several hosts)
        for msg in attached.held:
            self._keep(msg, runs, attached.labels)
        running: dict[int, set[int]] = {}
        for info in attached.ranks:
            if info.alive and info.running is not None and info.rank not in runs.get(info.running, _NO_RUN).results:
                running.setdefault(info.running, set()).add(info.rank)
                if info.running not in runs:
                    runs[info.running] = DetachedRun(info.running, attached.labels.get(info.running)
                                                     or f"request {info.running}")
        for req_id, run in runs.items():  # still running: this kernel follows it to its end
            if req_id in running or run.request is not None:
                run.running |= running.get(req_id, set())
                run.request = self.requests.adopt(req_id, run.label, running.get(req_id, ()), run.results)
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
            state.pid, state.exit_code, state.signal = msg.pid, msg.exit_code, msg.signal
