"""A host agent as a Slurm job step: `srun` on one node of an allocation, then an encrypted link to it keyed
by munge credentials (srun's stdio is readable on the cluster network: only bound public values cross it in
clear), over a direct TCP link where the node offers one, else over the step's stdin and stdout.
`slurm.py` makes and watches the allocation."""

from __future__ import annotations

import asyncio
import ctypes
import enum
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.controller.direct_join import direct_target, join_direct
from monarch_kernel.controller.slurm import job_state, node_state
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.wire.link_crypto import DOWN, Opener, Sealer
from monarch_kernel.wire.munge_auth import Join, MungeFailed
from monarch_kernel.wire.relay_link import RelayLink, pipe_streams

OFFER_TIMEOUT_S = 300.0  # srun, the node's --setup line and python's start, until the agent offers its link


def _death_signal() -> Callable[[], None] | None:
    """What the forked srun runs before exec: SIGKILL it when the controller's thread goes.

    libc is looked up here, in the parent: the child of a threaded process must not dlopen.
    """
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (Slurm then ends the step)


class StepLink(enum.StrEnum):
    """What a step's link to the controller rides on."""

    STARTING = "starting"  # not attached yet: the pipes are ours
    STDIO = "stdio"  # encrypted records on srun's stdin/stdout (the link owns the pipes)
    DIRECT = "direct"  # encrypted records on a TCP link to the node
    CLOSED = "closed"


@dataclass
class SlurmStep:
    """A host agent running as a job step on one node.

    The agent and the controller key an encrypted link with munge (`wire.munge_auth`). With
    `direct`, the agent offers it as a TCP link on the node's address: bulk data then skips srun's
    stdio forwarding (about 10 MB/s). If the node cannot be reached, the link rides the pipes.
    """

    scheduled = True  # Slurm says why a rank or the whole step went away (time limit, scancel, a dead node)

    job_id: str
    node: str
    process: subprocess.Popen
    read_fd: int
    write_fd: int
    log_path: str
    python: str
    address: str = ""
    env: dict[str, str] | None = None  # sent as the link's first encrypted frame
    channel: StepLink = StepLink.STARTING  # what the link rides on

    @classmethod
    def start(cls, job_id: str, node: str, *, python: str, setup: str | None, env: dict[str, str],
              log_path: str, address: str = "", direct: bool = True, persist: bool = False) -> SlurmStep:
        """srun the agent on node (the environment follows, encrypted, once the link is keyed).

        persist: the step outlives the kernel (srun does not die with it; the agent waits for the next)."""
        to_agent_r, to_agent_w = os.pipe()
        from_agent_r, from_agent_w = os.pipe()
        from monarch_kernel.controller.ssh import agent_command

        command = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                   "--unbuffered", f"--job-name=monarch-agent-{node}",
                   "/bin/sh", "-c", agent_command(python=python, name=node, setup=setup, env=env, munge=True,
                                                  direct_address=address if direct and address else None,
                                                  persist=persist)]
        if shutil.which("srun") is None:
            raise MeshStartError("srun is not on PATH: is this machine a Slurm login node?")
        with open(log_path, "ab") as log:
            # a session of its own: the kernel's SIGINT must not reach srun (it would signal the tasks)
            process = subprocess.Popen(command, stdin=to_agent_r, stdout=from_agent_w, stderr=log,
                                       preexec_fn=None if persist else _death_signal(), start_new_session=True,
                                       close_fds=True)
        os.close(to_agent_r)
        os.close(from_agent_w)
        return cls(job_id, node, process, from_agent_r, to_agent_w, log_path, python, address, dict(env))

    async def attach(self, on_message: Callable[[Any], None],
                     on_close: Callable[[Exception | None], None]) -> RelayLink:
        """The encrypted link to the agent: over TCP if the node offers it and can be reached, else srun's pipes."""
        said = (await self._read_offer()).split()
        if said[:2] == ["link", "refused"]:
            raise MeshStartError(f"the agent on node {self.node} cannot authenticate its link: {' '.join(said[2:])}")
        if len(said) < 2 or said[0] not in ("direct", "stdio"):
            raise MeshStartError(f"the agent on node {self.node} said {' '.join(said)[:200]!r} where a link offer "
                                 "was due (another monarch_kernel version on the node?)")
        join = await self._join(said[-1].encode())
        sealer, opener = self._ends(join)
        first = join.message + b"".join(self._first_records(sealer))  # (the same bytes on either way: no nonce twice)
        if said[0] == "direct":
            target = direct_target(said[1:-1], self.address)
            if isinstance(target, str):
                self._stay_on_stdio(f"node {self.node}: {target}; data moves through srun's stdio instead")
            elif target is not None:
                ip, port = target
                try:
                    sock = await asyncio.to_thread(join_direct, ip, port, first)
                except OSError as exc:
                    self._stay_on_stdio(f"node {self.node}: the direct link to {ip}:{port} failed ({exc}); data "
                                        "moves through srun's stdio instead (about 10x slower for large tensors)")
                else:
                    self.channel = StepLink.DIRECT
                    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
                    return RelayLink(reader, writer, (sealer, opener), DOWN, on_message, on_close)
            else:
                os.write(self.write_fd, b"stdio\n")
        os.write(self.write_fd, first)
        self.channel = StepLink.STDIO  # the link owns the pipes from here
        reader, writer = await pipe_streams(self.read_fd, self.write_fd)
        return RelayLink(reader, writer, (sealer, opener), DOWN, on_message, on_close)

    def _stay_on_stdio(self, why: str) -> None:
        self._log(why)
        print(f"monarch_kernel: {why}", file=sys.stderr, flush=True)
        os.write(self.write_fd, b"stdio\n")

    async def _join(self, credential: bytes) -> Join:
        try:
            return await asyncio.to_thread(Join, credential)
        except MungeFailed as exc:
            raise MeshStartError(f"the link to the agent on node {self.node} cannot be authenticated: {exc}. "
                                 "Slurm meshes key their encrypted link with munge: check that `munge -n | unmunge` "
                                 "works on this machine and on the node") from None

    @staticmethod
    def _ends(join: Join) -> tuple[Sealer, Opener]:
        seal_key, open_key = join.session.keys_for(DOWN)
        return Sealer(seal_key), Opener(open_key)

    def _first_records(self, sealer: Sealer) -> list[bytes]:
        """The environment, as the link's first frame (the agent reads it before anything else)."""
        return sealer.seal([json.dumps(self.env or {}).encode()])

    async def _read_offer(self, timeout: float = OFFER_TIMEOUT_S) -> str:
        """The agent's first line: `direct IP PORT CREDENTIAL`, `stdio CREDENTIAL` or `link refused WHY`."""
        loop = asyncio.get_running_loop()
        line = bytearray()
        done: asyncio.Future[bytes] = loop.create_future()

        def readable() -> None:
            try:
                byte = os.read(self.read_fd, 1)
            except BlockingIOError:
                return
            line.extend(byte)
            if done.done():
                return
            if not byte or len(line) > 8192:
                done.set_result(b"")
            elif byte == b"\n":
                done.set_result(bytes(line))

        os.set_blocking(self.read_fd, False)
        loop.add_reader(self.read_fd, readable)
        try:
            said = await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise MeshStartError(f"the agent on node {self.node} did not start within {timeout:.0f} s "
                                 f"(see {self.log_path})") from None
        finally:
            loop.remove_reader(self.read_fd)
        if not said.startswith((b"direct ", b"stdio ", b"link refused")):
            raise MeshStartError(await self.explain_exit())
        return said.decode(errors="replace").strip()

    def _log(self, text: str) -> None:
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"monarch_kernel controller: {text}\n")

    async def wait_closed(self) -> None:
        """Until srun (and so the step) has ended."""
        while self.process.poll() is None:
            await asyncio.sleep(0.05)

    def job_ended(self) -> str:
        """What Slurm says if the job is no longer running ("" while it runs, or if Slurm cannot say)."""
        said = self._slurm_says()
        return "" if said is None or said.endswith(" is RUNNING") else said

    def lost_reason(self) -> str:
        """What Slurm says of the job now, for the error of a lost node ("" if Slurm cannot say)."""
        said = self._slurm_says()
        if said is not None and said.endswith(" is RUNNING"):
            return (f"{said}, and says node {self.node} is {node_state(self.node)}: the node, its network "
                    "or its agent failed (Slurm notices a dead node only after its SlurmdTimeout)")
        return said or ""

    def _slurm_says(self) -> str | None:
        try:
            state, reason, _ = job_state(self.job_id)
        except (MeshStartError, subprocess.TimeoutExpired, OSError):
            return None
        if not state:
            return f"Slurm no longer knows job {self.job_id} (it ended)"
        return f"Slurm job {self.job_id} is {state}" + (f" ({reason})" if reason not in ("", "None") else "")

    async def remove_shipped(self) -> None:
        """Nothing is shipped to Slurm nodes (they run the cluster's own environment)."""

    def let_go(self) -> None:
        """A persistent mesh's kernel ends: srun and the step go on; only our ends of its pipes close."""
        self._close_pipes()

    def close(self) -> None:
        """End the step: srun passes SIGTERM on to the agent, which stops its ranks."""
        if self.process.poll() is None:
            self.process.terminate()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.channel in (StepLink.STARTING, StepLink.DIRECT):  # the pipes are ours alone (on stdio the connection owns them)
            for fd in (self.read_fd, self.write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.channel = StepLink.CLOSED

    async def explain_exit(self, timeout: float = 3.0) -> str:
        """Why the step ended, from srun's status and the log."""
        try:
            await asyncio.wait_for(self.wait_closed(), timeout)
        except TimeoutError:
            pass
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                tail = "".join(f.readlines()[-20:])
        except OSError:
            tail = ""
        if "No module named" in tail and "monarch_kernel" in tail:
            return (f"monarch_kernel is not importable on node {self.node} with {self.python}: install it in "
                    "an environment the nodes share, and pass --python")
        return (f"the agent step on node {self.node} (job {self.job_id}) ended (srun status "
                f"{self.process.poll()})" + (f":\n{tail}" if tail else ""))
