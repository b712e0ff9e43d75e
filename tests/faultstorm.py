"""A fault storm: cells, pushes and actor calls on a live mesh while faults land at random.

Used by tests/test_fault_storm.py (a short storm, asserting every invariant) and by
benchmarks/fault_storm.py (long storms, with a report per fault kind). Every choice comes
from one `random.Random(seed)`, so a failing storm can be replayed with its seed.

Each round injects one fault (or one hostile input) into real work, then checks:
- the controller answers, and every call ended within its timeout (nothing hangs);
- a failure names the rank, its host and the cause;
- the fault was detected within the promised time (rank: 1 s; host: 5 s);
- a restart (when the fault needs one) brings back a full working mesh;
- a tensor pushed before the fault can be pushed again and comes back equal.
After `down`: no process, shared-memory folder or run folder of the mesh is left, and the
kernel's file descriptors and threads did not grow.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
from conftest import wait_until

from monarch_kernel import (
    Actor,
    MeshInterrupted,
    MeshTimeoutError,
    RemoteError,
    endpoint,
)
from monarch_kernel.api.sinks import PlainSink

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file

RANK_DETECT_S = 1.0  # promised: a dead rank is named within this
HOST_DETECT_S = 5.0  # promised: a lost host is named within this
CALL_TIMEOUT_S = 60.0  # no call of the storm may take longer (a hang is a failure)
LEAK_WAIT_S = 15.0
# sshd drops a client silent for ClientAliveInterval x ClientAliveCountMax seconds, and a
# kernel holding the GIL cannot answer: the storm's hosts allow 10 x 3 s (OpenSSH's default
# never drops), so that its 10 s holds test our side, not that server setting
SERVER_CLIENT_ALIVE = (10, 3)
FD_SLACK = 12
THREAD_SLACK = 4


class Ping(Actor):
    """An actor the storm calls between faults."""

    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return int(os.environ["RANK"])


@dataclass
class Outcome:
    """What became of one injected fault."""

    kind: str
    round: int
    detected: bool = False
    detect_s: float | None = None
    recovered: bool = False
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    """A storm's outcomes, and what was left behind after `down`."""

    seed: int
    mode: str
    outcomes: list[Outcome] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        """Every violated invariant, with its round and fault."""
        found = [f"round {o.round} ({o.kind}): {p}" for o in self.outcomes for p in o.problems]
        return found + [f"after down: {leak}" for leak in self.leaks]

    def rows(self) -> list[tuple[str, int, int, str, str, int, int]]:
        """Per fault kind: injected, detected, median and max time to detect, recovered, problems."""
        kinds: dict[str, list[Outcome]] = {}
        for outcome in self.outcomes:
            kinds.setdefault(outcome.kind, []).append(outcome)
        rows = []
        for kind, outs in sorted(kinds.items()):
            times = [o.detect_s for o in outs if o.detect_s is not None]
            rows.append((kind, len(outs), sum(o.detected for o in outs),
                         f"{statistics.median(times):.3f}" if times else "-", f"{max(times):.3f}" if times else "-",
                         sum(o.recovered for o in outs), sum(len(o.problems) for o in outs)))
        return rows

    def table(self) -> str:
        """The report as a text table."""
        head = ("fault", "injected", "detected", "detect median s", "detect max s", "recovered", "problems")
        lines = [" | ".join(head), " | ".join("---" for _ in head)]
        lines += [" | ".join(str(c) for c in row) for row in self.rows()]
        lines.append(f"leaked after down: {', '.join(self.leaks) if self.leaks else 'nothing'}")
        return "\n".join(lines)


def kernel_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def hold_the_gil(seconds: float) -> float:
    """One C call that never releases the GIL (a catastrophic regex) for about `seconds`."""
    n, took = 18, 0.0
    while took < 0.2:
        n += 1
        start = time.monotonic()
        re.match(r"(a+)+$", "a" * n + "b")
        took = time.monotonic() - start
    n += max(0, round(math.log2(seconds / took)))
    start = time.monotonic()
    re.match(r"(a+)+$", "a" * n + "b")
    return time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class _Interrupter:
    """Delivers a Ctrl-C (SIGINT) to the main thread at a chosen moment, only while armed.

    The handler runs in the main thread and raises only when that thread armed it, so a
    late signal can never land outside the operation it was meant for.
    """

    def __init__(self) -> None:
        self.armed = False
        self.fired = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupter:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            self.fired = True
            raise KeyboardInterrupt

    def after(self, delay: float) -> threading.Timer:
        """Send SIGINT to this process after delay seconds (Python runs the handler in the main thread)."""
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()
        return timer


class QuietSink(PlainSink):
    """Output goes nowhere: the storm's cells print only to be survived."""

    _devnull = open(os.devnull, "w")  # one for the process: a storm must not leak descriptors

    def __init__(self) -> None:
        super().__init__(stream=QuietSink._devnull)


class FaultStorm:
    """Rounds of work with one fault each, on a mesh made by `make_mesh`.

    hosts: the SSH test hosts when the mesh runs on them (enables link faults).
    """

    LOCAL_FAULTS = ("rank_sigkill", "rank_sigstop", "agent_sigkill", "gil_hold_10s", "interrupt_cell",
                    "interrupt_push", "interrupt_start", "restart_mid_cell", "oversized_output",
                    "unpicklable_value", "shm_write_fails")
    SSH_FAULTS = ("rank_sigkill", "rank_sigstop", "agent_sigkill", "link_down_up", "gil_hold_10s",
                  "interrupt_cell", "interrupt_push", "interrupt_start", "restart_mid_cell", "oversized_output",
                  "unpicklable_value")  # no shared memory between hosts: no shm fault

    def __init__(self, make_mesh: Callable[[], Any], *, seed: int, hosts: Any = None,
                 kinds: tuple[str, ...] | None = None, weights: dict[str, float] | None = None,
                 log: Callable[[str], None] | None = None):
        self.make_mesh = make_mesh
        self.seed = seed
        self.rng = random.Random(seed)
        self.hosts = hosts
        self.kinds = kinds or (self.SSH_FAULTS if hosts is not None else self.LOCAL_FAULTS)
        self.weights = [(weights or {}).get(k, 1.0) for k in self.kinds]
        self.log = log or (lambda _line: None)
        self.mesh: Any = None
        self.ref: Any = None
        self.report = Report(seed, "ssh" if hosts is not None else "local")
        self.sink = QuietSink()
        self._pids: set[int] = set()

    # ------------------------------------------------------------ the storm
    def run(self, rounds: int | None = None, seconds: float | None = None) -> Report:
        """Run rounds (or until seconds pass), then `down`, then look for leftovers."""
        import torch

        start = time.monotonic()
        self.mesh = self.make_mesh()
        name, run_dir, shm_dir = self.mesh.name, self.mesh._runtime.state.run_dir, self.mesh._runtime.state.shm_dir
        self.ref = torch.randn(512, 1024, generator=torch.Generator().manual_seed(self.seed))  # 2 MiB
        self.mesh.push(ref=self.ref)
        self._ensure_actor()
        self._note_pids()
        fds = threads = None
        number = 0
        try:
            while (rounds is None or number < rounds) and (seconds is None or time.monotonic() - start < seconds):
                kind = self.rng.choices(self.kinds, self.weights)[0]
                outcome = Outcome(kind, number)
                self.log(f"round {number}: {kind}")
                try:
                    getattr(self, f"_{kind}")(outcome)
                except Exception as exc:  # noqa: BLE001 - the invariant broke: record it and go on
                    outcome.problems.append(f"{type(exc).__name__}: {exc}")
                self._check_after(outcome)
                self.report.outcomes.append(outcome)
                if number == 0:  # after one round everything lazily made exists
                    fds, threads = kernel_fds(), threading.active_count()
                number += 1
            if fds is not None and kernel_fds() > fds + FD_SLACK:
                self.report.leaks.append(f"kernel file descriptors grew from {fds} to {kernel_fds()}")
            if threads is not None and threading.active_count() > threads + THREAD_SLACK:
                names = sorted(t.name for t in threading.enumerate())
                self.report.leaks.append(f"kernel threads grew from {threads} to {len(names)}: {names}")
        finally:
            self.mesh.shutdown()
        self._check_leftovers(name, run_dir, shm_dir)
        self.report.seconds = time.monotonic() - start
        return self.report

    # ------------------------------------------------------------ invariants
    def _check_after(self, outcome: Outcome) -> None:
        """The mesh works (restarting it if the fault left dead ranks) and the pushed tensor matches."""
        import torch

        mesh = self.mesh
        try:
            if not self._controller_answers(5.0):
                outcome.problems.append("the controller did not answer within 5 s")
            if any(s.state in ("dead", "unresponsive") for s in mesh.status()):
                mesh.restart()
                self._note_pids()
            ranks = mesh.run("int(__import__('os').environ['RANK'])", timeout=CALL_TIMEOUT_S, sink=self.sink).by_rank()
            if ranks != {r: r for r in mesh.ranks}:
                outcome.problems.append(f"after recovery the ranks answered {ranks}")
            mesh.push(ref=self.ref)
            back = mesh.pull("ref", timeout=CALL_TIMEOUT_S)
            if not all(torch.equal(v, self.ref) for v in back.values()):
                outcome.problems.append("the tensor pushed again did not come back equal")
            self._ensure_actor()
            echoed = self.pinger.echo.call(outcome.round).get(timeout=CALL_TIMEOUT_S)
            if set(echoed.values()) != {outcome.round}:
                outcome.problems.append(f"the actor answered {set(echoed.values())}")
            outcome.recovered = not outcome.problems
        except Exception as exc:  # noqa: BLE001
            outcome.problems.append(f"recovery failed: {type(exc).__name__}: {exc}")

    def _ensure_actor(self) -> None:
        """Spawn the storm's actor again when its ranks were replaced (a restart loses actors)."""
        pids = tuple(s.pid for s in self.mesh.status())
        if pids != getattr(self, "_actor_pids", None):
            self.pinger = self.mesh.spawn("storm", Ping)
            self._actor_pids = pids

    def _controller_answers(self, timeout: float) -> bool:
        async def nothing() -> bool:
            return True

        try:
            return bool(self.mesh._runtime.controller.run(nothing()).result(timeout))
        except Exception:  # noqa: BLE001
            return False

    def _note_pids(self) -> None:
        self._pids.update(s.pid for s in self.mesh.status() if s.pid)
        self._pids.update(pid for pid in (self._agent_pid(i) for i in range(len(self.mesh.hosts))) if pid)

    def _check_leftovers(self, name: str, run_dir: str | None, shm_dir: str | None) -> None:
        if not wait_until(lambda: not [p for p in self._pids if _alive(p)], LEAK_WAIT_S):
            self.report.leaks.append(f"processes still running: {sorted(p for p in self._pids if _alive(p))}")
        for folder in (run_dir, shm_dir):
            if folder and os.path.exists(folder):
                self.report.leaks.append(f"folder {folder} is still there")
        if self.hosts is not None:
            def clean() -> bool:
                return not any(self._agent_pids_on(h) for h in self.hosts.hosts)

            if not wait_until(clean, LEAK_WAIT_S):
                self.report.leaks.append("an agent still runs on a test host")
            left = subprocess.run(["bash", "-c", "ls -d /tmp/monarch-store-* 2>/dev/null"], capture_output=True, text=True)
            if left.stdout.strip():
                self.report.leaks.append(f"store folders left: {left.stdout.split()}")

    # ------------------------------------------------------------ helpers
    def _agent_pid(self, host: int) -> int | None:
        link = self.mesh._runtime.state.links[host]
        if link.host is not None and link.host.process is not None:
            return int(link.host.process.pid)
        # a remote host's current agent is the parent of its ranks (an agent cut off by an
        # earlier round may still be running there until it notices)
        name = self.mesh.hosts[host]
        ranks = [s.pid for s in self.mesh.status() if s.host == name and s.pid]
        return _parent(ranks[0]) if ranks else None

    def _agent_pids_on(self, host: Any) -> list[int]:
        """Agents running in a test host: agent processes whose parent is not one (ranks are their children)."""
        def is_agent(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return b"monarch_kernel.agent" in f.read() and _alive(pid)
            except OSError:
                return False

        return sorted(pid for pid in self.hosts.pids(host) if is_agent(pid) and not is_agent(_parent(pid)))

    def _busy_cell(self, seconds: float = 30.0, fail_fast: bool = True) -> Any:
        future = self.mesh.run_async(f"import time\ntime.sleep({seconds})", timeout=CALL_TIMEOUT_S,
                                     fail_fast=fail_fast, sink=self.sink)
        if not wait_until(lambda: all(s.state == "busy" for s in self.mesh.status()), 10):
            raise RuntimeError("the ranks did not all start the cell within 10 s")
        return future

    def _expect_failure(self, outcome: Outcome, future: Any, started: float, promised: float,
                        rank: int | None, words: tuple[str, ...]) -> None:
        """The future fails, in time, with a message naming the rank, its host and the cause."""
        try:
            future.get(timeout=CALL_TIMEOUT_S)
        except MeshTimeoutError:
            outcome.problems.append(f"the cell hung until its {CALL_TIMEOUT_S:g} s timeout")
            return
        except RemoteError as exc:
            took = time.monotonic() - started
            outcome.detected, outcome.detect_s = True, took
            text = str(exc)
            if took > promised:
                outcome.problems.append(f"detected after {took:.2f} s (promised {promised:g} s)")
            host = self.mesh.status()[rank].host if rank is not None else None
            wanted = ([f"rank {rank}"] if rank is not None else []) + ([host] if host else []) + list(words)
            missing = [w for w in wanted if w not in text]
            if missing:
                outcome.problems.append(f"the error does not name {missing}: {text[:300]}")
            return
        outcome.problems.append("the cell succeeded although a fault hit it")

    # ------------------------------------------------------------ faults
    def _rank_sigkill(self, outcome: Outcome) -> None:
        future = self._busy_cell()
        rank = self.rng.randrange(len(self.mesh.ranks))
        pid = self.mesh.status()[rank].pid
        time.sleep(self.rng.uniform(0, 0.3))
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_until(future.done, CALL_TIMEOUT_S)
        self._expect_failure(outcome, future, started, RANK_DETECT_S, rank, ("SIGKILL",))

    def _rank_sigstop(self, outcome: Outcome) -> None:
        """A stopped rank is slow, not dead: the cell waits for it and ends well once it resumes."""
        future = self.mesh.run_async("import time, os\ntime.sleep(0.5)\nint(os.environ['RANK'])",
                                     timeout=CALL_TIMEOUT_S, sink=self.sink)
        rank = self.rng.randrange(len(self.mesh.ranks))
        pid = self.mesh.status()[rank].pid
        pause = self.rng.uniform(0.1, 2 * self.mesh.health.unresponsive_after_s)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            flagged = wait_until(lambda: self.mesh.status()[rank].state == "unresponsive", pause)
            if flagged:
                outcome.detected, outcome.detect_s = True, time.monotonic() - started
                if outcome.detect_s > self.mesh.health.unresponsive_after_s + 2 * self.mesh.health.ping_interval_s:
                    outcome.problems.append(f"unresponsive shown after {outcome.detect_s:.2f} s")
            else:  # a stop shorter than the silence limit plus one heartbeat report is not a fault yet
                health = self.mesh.health
                outcome.detected = pause < health.unresponsive_after_s + health.heartbeat_interval_s + health.ping_interval_s
        finally:
            os.kill(pid, signal.SIGCONT)
        values = future.get(timeout=CALL_TIMEOUT_S).by_rank()
        if values != {r: r for r in self.mesh.ranks}:
            outcome.problems.append(f"the cell around the stop gave {values}")
        if not wait_until(lambda: self.mesh.status()[rank].state == "idle", 10):
            outcome.problems.append(f"rank {rank} stayed {self.mesh.status()[rank].state} after SIGCONT "
                                    f"({self.mesh.status()[rank]!r}; {self.mesh.why().text()[:1500]})")

    def _agent_sigkill(self, outcome: Outcome) -> None:
        future = self._busy_cell(fail_fast=False)
        host = self.rng.randrange(len(self.mesh.hosts))
        pid = self._agent_pid(host)
        if pid is None:
            raise RuntimeError(f"no agent found for host {host}")
        ranks = [s.rank for s in self.mesh.status() if s.host == self.mesh.hosts[host]]
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self._expect_failure(outcome, future, started, HOST_DETECT_S, ranks[0], ())
        self._finish_cell_elsewhere()

    def _link_down_up(self, outcome: Outcome) -> None:
        future = self._busy_cell(fail_fast=False)
        index = self.rng.randrange(len(self.mesh.hosts))
        host = self.hosts.hosts[index]
        rank = next(s.rank for s in self.mesh.status() if s.host == self.mesh.hosts[index])
        started = time.monotonic()
        self.hosts.cut_link(host)
        try:
            self._expect_failure(outcome, future, started, HOST_DETECT_S, rank, ("lost",))
        finally:
            time.sleep(self.rng.uniform(0, 1.0))  # the cable stays out a random while
            self.hosts.restore_link(host)
        self._finish_cell_elsewhere()

    def _finish_cell_elsewhere(self) -> None:
        """Ranks of other hosts still sleep in the cell: stop them before recovery."""
        self.mesh.interrupt()
        wait_until(lambda: not any(s.state == "busy" for s in self.mesh.status()), 10)

    def _gil_hold_10s(self, outcome: Outcome) -> None:
        """The notebook's own thread holds the GIL for 10 s while the ranks work: nothing is lost."""
        pids = [s.pid for s in self.mesh.status()]
        future = self.mesh.run_async("import time, os\ntime.sleep(1)\nint(os.environ['RANK'])", timeout=CALL_TIMEOUT_S,
                                     sink=self.sink)
        held = hold_the_gil(10.0)
        outcome.detect_s = None
        values = future.get(timeout=CALL_TIMEOUT_S).by_rank()
        outcome.detected = True  # nothing to detect: the check is that nothing broke
        if values != {r: r for r in self.mesh.ranks}:
            outcome.problems.append(f"after holding the GIL {held:.1f} s the cell gave {values}")
        if [s.pid for s in self.mesh.status()] != pids or any(s.state == "dead" for s in self.mesh.status()):
            outcome.problems.append(f"holding the GIL {held:.1f} s cost ranks: {self.mesh.status()}")

    def _interrupted(self, outcome: Outcome, action: Callable[[], Any], delay: float) -> None:
        """Run action with a Ctrl-C arriving after delay; the stop must take effect (or the action finish)."""
        with _Interrupter() as ctrl_c:
            timer = ctrl_c.after(delay)
            started = time.monotonic()
            try:
                ctrl_c.armed = True
                action()
            except (KeyboardInterrupt, MeshInterrupted):
                outcome.detected, outcome.detect_s = True, max(0.0, time.monotonic() - started - delay)
            finally:
                ctrl_c.armed = False
                timer.cancel()
        if not ctrl_c.fired:
            outcome.detected = True  # it finished before the stop button was pressed

    def _interrupt_cell(self, outcome: Outcome) -> None:
        self._interrupted(outcome, lambda: self.mesh.run("import time\ntime.sleep(20)", timeout=CALL_TIMEOUT_S,
                                                                  sink=self.sink),
                          self.rng.uniform(0.0, 0.5))
        if outcome.detect_s is not None and outcome.detect_s > 2.0:
            outcome.problems.append(f"the stop took {outcome.detect_s:.2f} s")

    def _interrupt_push(self, outcome: Outcome) -> None:
        import torch

        big = torch.ones(16 << 20)  # 64 MiB
        self._interrupted(outcome, lambda: self.mesh.push(big=big), self.rng.uniform(0.0, 0.1))

    def _interrupt_start(self, outcome: Outcome) -> None:
        self._interrupted(outcome, self.mesh.restart, self.rng.uniform(0.0, 0.15))
        self._note_pids()
        if any(s.state != "idle" for s in self.mesh.status()):
            self.mesh.restart()  # what a user does after stopping a restart half-way
            self._note_pids()

    def _restart_mid_cell(self, outcome: Outcome) -> None:
        future = self._busy_cell(fail_fast=False)
        started = time.monotonic()
        self.mesh.restart()
        self._note_pids()
        try:
            future.get(timeout=CALL_TIMEOUT_S)
            outcome.problems.append("a cell whose ranks were restarted reported success")
        except MeshTimeoutError:
            outcome.problems.append("the cell of the restarted ranks hung")
        except (RemoteError, MeshInterrupted) as exc:
            outcome.detected, outcome.detect_s = True, time.monotonic() - started
            if "restart" not in str(exc):
                outcome.problems.append(f"the cell's error does not say the ranks were restarted: {str(exc)[:200]}")

    def _oversized_output(self, outcome: Outcome) -> None:
        code = ("import os, sys\nos.write(1, b'x' * (12 << 20))\nos.write(2, b'\\xff\\xfe not utf-8 \\xc3\\n')\n"
                "print('y' * (10 << 20))\nsys.stdout.flush()\n'done'")
        values = self.mesh.run(code, timeout=CALL_TIMEOUT_S, sink=self.sink)
        outcome.detected = True
        if set(values.values()) != {"done"}:
            outcome.problems.append(f"the cell gave {set(values.values())}")

    def _unpicklable_value(self, outcome: Outcome) -> None:
        """A cell's unpicklable result shows as a stand-in; pulling or pushing one names it."""
        import threading as threads_here

        shown = self.mesh.run("import threading\nthreading.Lock()", timeout=CALL_TIMEOUT_S, sink=self.sink)
        if not all("unpicklable lock" in repr(v) for v in shown.values()):
            outcome.problems.append(f"an unpicklable cell result showed as {list(shown.values())}")
        for action, words in ((lambda: self.mesh.pull("threading.Lock()", timeout=CALL_TIMEOUT_S), "SerializationError"),
                              (lambda: self.mesh.push(lock=threads_here.Lock()), "variable 'lock'")):
            try:
                action()
                outcome.problems.append(f"an unpicklable value raised nothing (expected {words})")
            except Exception as exc:  # noqa: BLE001 - checked by its text
                if words not in str(exc) and words not in type(exc).__name__:
                    outcome.problems.append(f"the error does not say {words!r}: {str(exc)[:200]}")
        outcome.detected = not outcome.problems

    def _shm_write_fails(self, outcome: Outcome) -> None:
        """A rank cannot write its result to /dev/shm (full, or a file size limit here)."""
        code = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                "_lim = resource.getrlimit(resource.RLIMIT_FSIZE)\n"
                "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, _lim[1]))\n"
                "try:\n    _v = ref.clone()\nfinally:\n    pass\n_v")
        try:
            values = self.mesh.run(code, timeout=CALL_TIMEOUT_S, sink=self.sink)
        finally:
            self.mesh.run("resource.setrlimit(resource.RLIMIT_FSIZE, _lim)", timeout=CALL_TIMEOUT_S, sink=self.sink)
        import torch

        outcome.detected = True
        if not all(torch.equal(v, self.ref) for v in values.values()):
            outcome.problems.append("a result that could not go through shared memory came back wrong")

