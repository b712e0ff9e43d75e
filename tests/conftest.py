import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from monarch_kernel import local_mesh  # noqa: E402
from monarch_kernel.api.sinks import PlainSink  # noqa: E402
from monarch_kernel.core import supervision  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def the_test_session_goes_on_after_unhandled_actor_failures():
    """The suite is one long-lived process, as a notebook's kernel is, whose tests spawn actors through the Monarch
    API and crash some of their processes on purpose. In a program Monarch's default fault hook ends the program
    (core/supervision.py): here, as in a notebook, a failure nobody handled is printed and the session goes on
    (Monarch's own tests set unhandled_fault_hook for the same reason). Programs the tests start as processes
    of their own keep the program's default."""
    in_a_shell = supervision.in_a_shell
    supervision.in_a_shell = lambda: True
    yield
    supervision.in_a_shell = in_a_shell


class RecordingSink(PlainSink):
    """A sink that keeps every event (and still behaves like the plain one)."""

    def __init__(self):
        super().__init__(stream=open(os.devnull, "w"))
        self.events = []

    def output(self, rank, stream, text):
        self.events.append(("output", rank, stream, text))

    def display(self, rank, data, metadata):
        self.events.append(("display", rank, data))

    def notice(self, rank, text):
        self.events.append(("notice", rank, text))

    def text(self, stream="stdout"):
        return {r: "".join(t for k, rr, s, t in (e for e in self.events if e[0] == "output") if rr == r and s == stream)
                for r in sorted({e[1] for e in self.events})}


@pytest.fixture
def sink():
    return RecordingSink()


@pytest.fixture(scope="module")
def mesh4():
    """A 4-rank gloo mesh shared by the tests of one module."""
    mesh = local_mesh(gpus=4, dist="gloo", name=f"test-{os.getpid()}")
    yield mesh
    mesh.shutdown()


def pids_alive(pids):
    """Which of these pids still exist (and are not zombies)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def wait_until(predicate, timeout):
    """Poll predicate until it holds (True) or the timeout passes (its last answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def ipython_shell():
    """The test IPython shell (globalipapp starts one on the first call only, and then returns None)."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    return get_ipython() or start_ipython() or get_ipython()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `unit` that starts a process (fork, exec, multiprocessing), in itself or in a
    fixture it sets up (module-scoped ones included), fails at once."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing
    import subprocess

    def refuse(*args, **kwargs):
        raise RuntimeError("a unit test may not start processes: mark it otherwise, or use the in-memory agent")

    patched = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "posix_spawn"), (multiprocessing.Process, "start")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name in patched:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


_CONFORMANCE = "test_conformance.py::test_a_monarch_program_prints_the_same_on_ours"


def pytest_terminal_summary(terminalreporter):
    """CI's output says how many Monarch programs print the same under ours as under torchmonarch 0.7.0."""
    outcomes = {}
    for outcome in ("passed", "failed", "skipped", "xfailed", "xpassed"):
        for report in terminalreporter.stats.get(outcome, []):
            if _CONFORMANCE in getattr(report, "nodeid", "") and getattr(report, "when", "call") in ("call", "setup"):
                outcomes[report.nodeid] = outcome
    if outcomes:
        same = sum(1 for o in outcomes.values() if o == "passed")
        terminalreporter.write_line(f"Monarch conformance: {same} of {len(outcomes)} programs print the same under "
                                    "monarch_kernel as under torchmonarch 0.7.0 (tests/conformance/programs)")
