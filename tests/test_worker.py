"""The rank runtime in-process, over a real socketpair (no agent)."""

import platform
import signal
import socket
import sys

import pytest

from monarch_kernel.rank.worker import Worker, WorkerConfig
from monarch_kernel.wire.calls import _default_sender
from monarch_kernel.wire.messages import Call, Output, Pull, Push, Result, RunCell, RunOp
from monarch_kernel.wire.ops import Describe, ListFiles, SetAutoreload, Versions
from monarch_kernel.wire.serialization import seal, unseal
from monarch_kernel.wire.transport import BlockingConnection

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


@pytest.fixture
def rank():
    a, b = socket.socketpair()
    saved = signal.getsignal(signal.SIGINT)  # a worker installs its own handler: not for the tests after this one
    worker = Worker(BlockingConnection(a), WorkerConfig(rank=3, host="h", shm_dir=None))
    peer = BlockingConnection(b)
    yield worker, peer
    peer.close()
    signal.signal(signal.SIGINT, saved)
    _default_sender.clear()  # the worker made itself this process's way to actors: not for the tests after this one


def request(worker, peer, msg):
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = worker.stdout, worker.stderr  # as worker.install() does in a rank
    try:
        worker.handle(msg)
    finally:
        sys.stdout, sys.stderr = old
    got = []
    while True:
        item = peer.recv()
        got.append(item)
        if isinstance(item, Result):
            return got


def test_output_arrives_before_the_result_it_belongs_to(rank):
    worker, peer = rank
    got = request(worker, peer, RunCell(7, "print('a')\nprint('b', file=__import__('sys').stderr)\n41 + 1", "<c>"))
    outputs, result = [o for o in got if isinstance(o, Output)], got[-1]
    text = {stream: "".join(o.text for o in outputs if o.stream == stream) for stream in ("stdout", "stderr")}
    assert text == {"stdout": "a\n", "stderr": "b\n"}  # possibly in several messages
    assert all(o.req_id == 7 and o.rank == 3 for o in outputs)
    assert result.req_id == 7 and result.failure is None and unseal(result.value) == 42


def test_push_pull_call_share_the_namespace(rank):
    worker, peer = rank
    request(worker, peer, Push(1, seal({"x": 5})))
    assert unseal(request(worker, peer, Pull(2, "x * 2"))[-1].value) == 10
    fn = seal(lambda: 5 + 1)  # Mesh.call: the user's function, called with nothing of ours
    assert unseal(request(worker, peer, Call(3, fn))[-1].value) == 6


def test_internal_operations_are_typed_and_answered_by_their_handlers(rank):
    worker, peer = rank
    request(worker, peer, Push(1, seal({"t": __import__("torch").zeros(2, 3)})))
    assert unseal(request(worker, peer, RunOp(2, Versions()))[-1].value)["python"] == platform.python_version()
    assert unseal(request(worker, peer, RunOp(3, Describe("t")))[-1].value).global_shape == (2, 3)
    assert unseal(request(worker, peer, RunOp(4, SetAutoreload(False)))[-1].value) is False
    result = request(worker, peer, RunOp(5, ListFiles("k")))[-1]  # a host operation is not a rank's
    assert result.failure.error_type == "TypeError" and "no operation ListFiles" in result.failure.message


def test_failures_and_stand_ins(rank):
    worker, peer = rank
    result = request(worker, peer, RunCell(1, "import sys\nsys.exit(3)", "<c>"))[-1]
    assert result.failure.error_type == "SystemExit"
    result = request(worker, peer, RunCell(2, "import threading\nthreading.Lock()", "<c>"))[-1]
    assert "unpicklable lock on rank 3" in repr(unseal(result.value))
    result = request(worker, peer, Pull(3, "threading.Lock()"))[-1]
    assert result.failure.error_type == "SerializationError"
    result = request(worker, peer, RunCell(4, "undefined_name", "<mesh In[4]>"))[-1]
    assert "NameError" in result.failure.traceback and "<mesh In[4]>" in result.failure.traceback
