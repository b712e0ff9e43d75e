"""Host operations answer with typed results (issue 41: replies typed as the requests are), and a reply of
another type fails the operation with a clear reason instead of reaching its caller."""

import asyncio

import pytest

from monarch_kernel.agent.ops import HANDLERS, run_host_operation
from monarch_kernel.controller.host_ops import HostOpFailed, HostOps
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import ops


class _Link:
    name = "host-a"

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)
        return True


def test_every_host_operation_names_its_answer_and_its_handler_returns_it(tmp_path):
    assert {op.answer for op in HANDLERS} == set(ops.HOST_OPERATION_RESULTS)
    path = tmp_path / "f.bin"
    path.write_bytes(b"0123456789")
    for op in (ops.DescribePath(str(path)), ops.Checksum(str(path)), ops.PrefixDigest(str(path), 4),
               ops.ReadChunk(str(path), 2, 3)):
        answer = run_host_operation(op)
        assert isinstance(answer, type(op).answer), (op, answer)
    assert run_host_operation(ops.Checksum(str(path))).size == 10
    assert bytes(run_host_operation(ops.ReadChunk(str(path), 2, 3)).data.raw()) == b"234"


def test_a_reply_of_the_wrong_type_fails_the_operation_with_the_reason():
    async def scenario():
        host_ops, link = HostOps(), _Link()
        right = host_ops.send(link, ops.Checksum("/x"))
        wrong = host_ops.send(link, ops.Checksum("/y"))
        host_ops.done(link, m.HostOpDone(link.sent[0].op_id, ops.FileChecksum("ab", 2)))
        host_ops.done(link, m.HostOpDone(link.sent[1].op_id, ops.PrefixChecksum("ab")))
        assert (await right).size == 2
        with pytest.raises(HostOpFailed, match="answered PrefixChecksum where FileChecksum was due"):
            await wrong
        with pytest.raises(TypeError, match="not a host operation"):
            host_ops.send(link, ops.Describe("x"))

    asyncio.run(scenario())
