"""A rank's place in a Ray placement group, and the node's host agent started from it.

The controller makes one `RankSlot` Ray actor per bundle of the mesh's placement group (one bundle
per rank): Ray places it, gives it the bundle's GPUs (`ray.get_gpu_ids()`) and keeps it alive as
long as the kernel that asked (the job that owns it). `where()` says on which node it landed and
which GPUs it holds; the first slot of each node then starts that node's host agent
(`start_agent`) as its child process, exactly as a Slurm step runs it: `--stdio --pinned KEY
--direct ADDRESS`, so the agent offers a direct TCP link keyed by public keys that Ray carried
(`wire/pinned_auth`). The slot holds the agent's stdin: when the slot goes (the kernel died and Ray
killed its actors, or the mesh's placement group was removed), the agent sees it close and stops
its ranks, and its parent-death signal says the same.

A persistent mesh's group and slots are detached (they outlive the kernel's Ray job), so nothing of
Ray's ends them: the slot that started an agent removes the mesh's placement group when that agent
ends with no kernel to do it (exit status `persist_messages.ENDED_WITHOUT_KERNEL`: its persist time ran out, or
`meshes stop`) or dies (any other status but 0), and Ray then ends every slot of the mesh. An end a
kernel asked for (status 0 after its `Shutdown`, or `stop_agent`: a restart, or `down`, after which
that kernel removes the group itself) leaves the group.

Runs inside a Ray worker on a node: the standard library and our wire types only (Ray itself is
imported by Ray), never the notebook's side of the package. The controller names this class when it
asks Ray for the slots (the one import of agent code by the controller: tests/test_architecture.py).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from monarch_kernel.wire.ray_messages import AgentLaunch, AgentStarted, SlotPlace

OFFER_WAIT_S = 120.0  # python's start and the agent's imports, until it offers its link
OFFER_LINE_MAX = 4096


class RankSlot:
    """A Ray actor holding one bundle of a mesh's placement group (see the module's note)."""

    def __init__(self, release_group_at_end: bool = False) -> None:
        self._agent: subprocess.Popen | None = None
        self._folder: str | None = None
        self._release_group_at_end = release_group_at_end  # a persistent mesh's (detached) slot
        self._asked_to_stop: set[int] = set()  # agents the controller ended (their end releases nothing)

    def where(self) -> SlotPlace:
        """The node this slot runs on and the GPUs Ray gave it."""
        import ray

        context = ray.get_runtime_context()
        ids = context.get_accelerator_ids().get("GPU", [])
        return SlotPlace(context.get_node_id(), ray.util.get_node_ip_address(), socket.gethostname(),
                         tuple(str(i) for i in ids), sys.executable)

    def start_agent(self, launch: AgentLaunch) -> AgentStarted:
        """Start the node's agent; its offer line and pid.

        Raises RuntimeError, with the end of the agent's log, if it ends or stays silent instead."""
        if self._agent is not None and self._agent.poll() is None:
            raise RuntimeError("this slot already runs an agent")
        self._folder = tempfile.mkdtemp(prefix="monarch-ray-agent-")  # private (0700): the agent's log
        env = dict(os.environ)
        if launch.extra_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (launch.extra_path, env.get("PYTHONPATH")) if p)
        env.setdefault("MPLBACKEND", "Agg")
        command = [launch.python or sys.executable, "-m", "monarch_kernel.agent", "--stdio", "--host", launch.host,
                   "--pinned", launch.controller_key, "--direct", launch.address, "--log-folder", self._folder]
        with open(self.log_path, "ab") as log:
            self._agent = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                           env=env, close_fds=True, start_new_session=True)
        assert self._agent.stdout is not None
        line = self._read_offer(self._agent.stdout.fileno())
        if not line:
            raise RuntimeError(f"the agent on {socket.gethostname()} ended before offering its link "
                               f"(status {self._agent.poll()}):\n{self.log_tail()}")
        if self._release_group_at_end:
            threading.Thread(target=self._release_when_ended, args=(self._agent,), name="agent-watch",
                             daemon=True).start()
        return AgentStarted(line, self._agent.pid)

    def _release_when_ended(self, agent: subprocess.Popen) -> None:
        """A detached slot: once `agent` ends on its own, remove the mesh's placement group (see the module's note)."""
        status = agent.wait()
        if agent.pid in self._asked_to_stop or status == 0:  # (0: a kernel's Shutdown; that kernel releases the group)
            return
        if self._folder is not None and self._agent is agent:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        from ray.util import get_current_placement_group, remove_placement_group

        group = get_current_placement_group()
        if group is not None:
            remove_placement_group(group)  # (Ray ends this slot and the mesh's others with it)

    @property
    def log_path(self) -> str:
        """The agent's log on this node."""
        return os.path.join(self._folder or tempfile.gettempdir(), "agent.log")

    def _read_offer(self, fd: int) -> str:
        line = bytearray()
        deadline = time.monotonic() + OFFER_WAIT_S
        while not line.endswith(b"\n") and len(line) < OFFER_LINE_MAX:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the agent on {socket.gethostname()} did not offer its link within "
                                   f"{OFFER_WAIT_S:.0f} s:\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                byte = os.read(fd, 1)
                if not byte:
                    return ""
                line += byte
        return line.decode(errors="replace").strip()

    def agent_exit(self) -> int | None:
        """The agent's exit status (None while it runs, or if none was started)."""
        return None if self._agent is None else self._agent.poll()

    def log_tail(self, lines: int = 20) -> str:
        """The end of the agent's log."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop_agent(self, pid: int, grace_s: float = 5.0) -> int | None:
        """End agent `pid` (its stdin closes and it gets SIGTERM; SIGKILL after grace_s); its exit status.

        A stop for an agent this slot no longer runs (a restart started the next one) does nothing."""
        agent = self._agent
        if agent is None or agent.pid != pid:
            return None
        self._asked_to_stop.add(pid)
        if agent.poll() is None:
            if agent.stdin is not None:
                agent.stdin.close()
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        return None if agent is None else agent.poll()
