"""Reaching the agents of a persistent mesh from a kernel that did not start it (or from a terminal).

A local agent listens on a Unix socket in the mesh's 0700 folder; we check that the socket is served by
the recorded agent pid, as our own user. An SSH host's agent listens on a Unix socket in a 0700 folder
of its own there; a new SSH connection (host key checked as always) forwards a private local socket to
it, and no TCP port is opened anywhere. Either way both ends then prove the mesh's secret without
sending it (`wire/direct_auth`), and every frame is sealed under the session key (`wire/relay_link`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from monarch_kernel.controller.hostspec import HostKind, HostSpec, ReachedAgentHandle
from monarch_kernel.controller.loop import ControllerLoop
from monarch_kernel.controller.ray_detached import DetachedRayGroup
from monarch_kernel.controller.runtime import settle
from monarch_kernel.controller.slurm import SlurmJob
from monarch_kernel.controller.state import MeshSpec
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.mesh_records import MeshRecord, RecordError
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import persist_messages as pm
from monarch_kernel.wire.direct_auth import AuthenticationFailed, prove_controller_async
from monarch_kernel.wire.lanes import peer_credentials
from monarch_kernel.wire.link_crypto import Session
from monarch_kernel.wire.relay_link import DOWN, RelayLink

ATTACH_TIMEOUT_S = 10.0


class MeshAttachError(RuntimeError):
    """A persistent mesh cannot be attached (held by another kernel, gone, or not proved)."""


class MeshGone(MeshAttachError):
    """The recorded agent does not answer: the mesh ended (or was killed) and left its record."""


class HostUnreachable(MeshGone):
    """The recorded agent's host cannot be reached now (SSH fails, its port times out): it may still run."""


@dataclass
class DirectAgent(ReachedAgentHandle):
    """A persistent mesh's agent on a Slurm or Ray node, reached by a new kernel on the TCP port it listens on (as the
    direct link: the mutual proof of the secret and sealed frames make it ours)."""

    node: str
    writer: asyncio.StreamWriter

    async def explain_exit(self) -> str:
        """Why it is gone: as far as we can tell from here."""
        return f"the direct link to the agent on node {self.node} ended"

    async def wait_closed(self) -> None:
        """Until the link is closed."""
        await self.writer.wait_closed()

    def close(self) -> None:
        """Close the link (the agent goes on)."""
        self.writer.close()


@dataclass
class ReachedAgent:
    """An authenticated stream to one agent, and the SSH forwarding it goes through (None: local)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    session: Session
    forwarded: Any = None  # how it was reached, if not on this machine: ssh.ForwardedAgent, DirectAgent

    def close(self) -> None:
        """Close the stream and the forwarding."""
        self.writer.close()
        if self.forwarded is not None:
            self.forwarded.close()


def agents_of(record: MeshRecord) -> list[dict[str, Any]]:
    """Each host's agent as the record has it: host, kind, socket, pid (and target, options over SSH)."""
    return record.agents or [{"host": record.hosts[0], "kind": "local", "socket": record.socket,
                              "pid": record.agent_pid}]


async def reach_agent(record: MeshRecord, index: int, local_dir: str) -> ReachedAgent:
    """Reach host `index`'s agent and prove the secret (raises MeshGone, or MeshAttachError saying why not).
    `local_dir`: a private folder for the local end of an SSH forwarding."""
    agent = agents_of(record)[index]
    forwarded = None
    where = f"its agent on {agent['host']}" + (f" (pid {agent['pid']})" if agent.get("pid") else "")
    gone = (f"mesh {record.name!r} is not running: {where} does not answer at {agent['socket']}; "
            f"`python -m monarch_kernel meshes stop {record.name}` removes its record")
    if agent["kind"] == HostKind.SSH:
        from monarch_kernel.controller import ssh

        path, expected_pid = os.path.join(local_dir, f"agent-{index}.sock"), os.getpid()  # (our own forwarding)
        try:
            forwarded = await ssh.forward_agent_socket(
                ssh.SSHTarget.parse(agent["target"]), options=agent.get("options") or {},
                timeout=float(agent.get("connect_timeout_s", 30.0)), remote_path=agent["socket"], local_path=path)
        except MeshStartError as exc:
            raise HostUnreachable(f"mesh {record.name!r}: cannot reach {agent['host']}: {exc}") from None
    elif agent["kind"] in (HostKind.SLURM, HostKind.RAY):
        return await _reach_node(record, agent, gone)
    else:
        path, expected_pid = agent["socket"], agent["pid"]
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path, limit=1 << 22), ATTACH_TIMEOUT_S)
    except (OSError, TimeoutError):
        if forwarded is not None:
            forwarded.close()
        raise MeshGone(gone) from None
    unproven = ReachedAgent(reader, writer, Session(b"", b""), forwarded)
    pid, uid = peer_credentials(writer.get_extra_info("socket"))
    if uid != os.getuid() or pid != expected_pid:
        unproven.close()
        raise MeshAttachError(f"the socket of mesh {record.name!r} is served by pid {pid} (uid {uid}), not by {where}: "
                              "refusing a stale or forged record")
    try:
        session = await prove_controller_async(reader, writer, bytes.fromhex(record.secret))
    except (AuthenticationFailed, ValueError) as exc:
        unproven.close()
        if forwarded is not None and "did not complete" in str(exc):  # the forwarding found no socket there
            raise MeshGone(gone) from None
        raise MeshAttachError(f"mesh {record.name!r}: {where} did not accept this record's secret ({exc}): "
                              "the record is stale or forged") from None
    return ReachedAgent(reader, writer, session, forwarded)


async def _reach_node(record: MeshRecord, agent: dict[str, Any], gone: str) -> ReachedAgent:
    host, _, port = agent["socket"][4:].rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), limit=1 << 22),
                                                ATTACH_TIMEOUT_S)
    except TimeoutError:
        raise HostUnreachable(f"{gone} (node {agent['host']} did not answer)") from None
    except (OSError, ValueError):
        raise MeshGone(gone) from None
    try:
        session = await prove_controller_async(reader, writer, bytes.fromhex(record.secret))
    except (AuthenticationFailed, ValueError) as exc:
        writer.close()
        raise MeshAttachError(f"mesh {record.name!r}: the agent on node {agent['host']} did not accept this record's "
                              f"secret ({exc}): the record is stale or forged") from None
    return ReachedAgent(reader, writer, session, DirectAgent(agent["host"], writer))


async def ask_agents(record: MeshRecord, request: pm.MeshQuery | pm.StopMesh,
                     timeout: float = ATTACH_TIMEOUT_S) -> list[pm.MeshInfo]:
    """One question to a persistent mesh's agents (how is it: host 0's; stop: every host's); the answers."""
    local_dir = tempfile.mkdtemp(prefix="monarch-reach-")
    try:
        hosts = range(len(agents_of(record))) if isinstance(request, pm.StopMesh) else range(1)
        found = await asyncio.gather(*(_ask_one(record, i, request, local_dir, timeout) for i in hosts),
                                     return_exceptions=True)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    answers = [a for a in found if isinstance(a, pm.MeshInfo)]
    problems = [a for a in found if isinstance(a, BaseException)]
    refused = [p for p in problems if isinstance(p, MeshAttachError) and not isinstance(p, MeshGone)]
    if refused or not answers:
        raise (refused or problems)[0]
    return answers


async def _ask_one(record: MeshRecord, index: int, request: Any, local_dir: str, timeout: float) -> pm.MeshInfo:
    reached = await reach_agent(record, index, local_dir)
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def closed(exc: Exception | None) -> None:
        if not answer.done():
            answer.set_exception(MeshGone(f"mesh {record.name!r}: its agent closed the link ({exc})"))

    link = RelayLink(reached.reader, reached.writer, reached.session, DOWN, lambda msg: settle(answer, msg), closed)
    link.send(request)
    try:
        return await asyncio.wait_for(answer, timeout)
    finally:
        link.close()
        with contextlib.suppress(Exception):
            reached.close()


async def stop_agents(record: MeshRecord, timeout: float = ATTACH_TIMEOUT_S) -> list[str]:
    """Ask every agent a record names to stop; the hosts that could not be reached (an agent already gone is
    stopped enough)."""
    local_dir = tempfile.mkdtemp(prefix="monarch-reach-")
    try:
        found = await asyncio.gather(*(_ask_one(record, i, pm.StopMesh(), local_dir, timeout)
                                       for i in range(len(agents_of(record)))), return_exceptions=True)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return [f"{agent['host']} ({answer})" for agent, answer in zip(agents_of(record), found)
            if isinstance(answer, BaseException) and (not isinstance(answer, MeshGone) or isinstance(answer, HostUnreachable))]


def ask_now(record: MeshRecord, request: pm.MeshQuery | pm.StopMesh) -> pm.MeshInfo | None:
    """`ask_agents` from any thread but the controller's: host 0's answer, or None if the mesh is gone (raises
    MeshAttachError for a record an agent refuses)."""
    try:
        return ControllerLoop.get().run(ask_agents(record, request)).result(ATTACH_TIMEOUT_S * 2 + 5)[0]
    except MeshGone:
        return None


def spec_fields(spec: MeshSpec) -> dict[str, Any]:
    """What a record keeps of a mesh's settings, beyond its shape and agents."""
    job = spec.allocation if isinstance(spec.allocation, SlurmJob) else None
    return {"env": spec.env, "preload": list(spec.preload), "health": dataclasses.asdict(spec.health),
            "start_timeout_s": spec.start_timeout_s, "master_addr": spec.master_addr,
            "slurm": {"job": job.job_id, "owned": job.owned, "keep": job.keep} if job is not None else None}


def spec_of(record: MeshRecord) -> MeshSpec:
    """The MeshSpec of a recorded mesh (its hosts as they were reached)."""
    try:
        saved = record.spec
        hosts = tuple(HostSpec(a["host"], HostKind(a["kind"]), target=a.get("target"),
                               options=dict(a.get("options") or {}) if a["kind"] == HostKind.SSH
                               else {"job": a["job"], "address": a["address"]} if a["kind"] == HostKind.SLURM
                               else {"address": a["address"]} if a["kind"] == HostKind.RAY else {},
                               connect_timeout_s=float(a.get("connect_timeout_s", 30.0))) for a in agents_of(record))
        job = saved.get("slurm")
        allocation: Any = None
        if record.kind == HostKind.RAY:  # the detached group, so that down removes it
            allocation = DetachedRayGroup.from_agents(agents_of(record), hosts)
        if job:  # the same job, so that down ends it if the mesh made it (and status shows its time left)
            allocation = SlurmJob(job["job"], [h.name for h in hosts], {h.name: h.options["address"] for h in hosts},
                                  owned=bool(job["owned"]), keep=bool(job["keep"]))
        return MeshSpec(record.name, hosts, record.gpus, record.dist, dict(saved.get("env", {})), saved.get("master_addr"),
                        float(saved.get("start_timeout_s", 120.0)), m.HealthTimings(**saved.get("health", {})),
                        preload=(), persist_s=record.persist_s, allocation=allocation)
    except (TypeError, ValueError, KeyError) as exc:
        raise RecordError(f"the record of mesh {record.name!r} has settings this version cannot read ({exc})") from None
