"""Frame reassembly, however the bytes arrive: one at a time, headers split, large parts."""

import random

import pytest

from monarch_kernel.wire import messages as m
from monarch_kernel.wire.serialization import seal, unseal
from monarch_kernel.wire.transport import FrameProtocol, encode

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def frames(*msgs):
    return b"".join(b"".join(bytes(c) for c in encode(msg)) for msg in msgs)


def feed(data: bytes, sizes):
    """Deliver `data` to a FrameProtocol the way asyncio's buffered reads do, in chunks of these sizes."""
    got = []
    proto = FrameProtocol(got.append, lambda exc: None)
    at = 0
    for size in sizes:
        if at >= len(data):
            break
        buf = proto.get_buffer(-1)
        n = min(size, len(buf), len(data) - at)
        buf[:n] = data[at:at + n]
        proto.buffer_updated(n)
        at += n
    while at < len(data):  # the rest in whatever the protocol asks for
        buf = proto.get_buffer(-1)
        n = min(len(buf), len(data) - at)
        buf[:n] = data[at:at + n]
        proto.buffer_updated(n)
        at += n
    return got


MSGS = [m.Ping(1), m.Output(2, 7, "stdout", "héllo\n"), m.Push(3, seal({"x": bytes(range(256)) * 600})),
        m.Pong(4), m.Shutdown()]


def check(got):
    assert [type(x) for x in got] == [type(x) for x in MSGS]
    assert got[0] == MSGS[0] and got[1] == MSGS[1] and got[3] == MSGS[3]
    assert unseal(got[2].values) == {"x": bytes(range(256)) * 600}


def test_one_byte_at_a_time():
    check(feed(frames(*MSGS), [1] * len(frames(*MSGS))))


@pytest.mark.parametrize("cut", [1, 3, 7, 8, 9, 15])
def test_headers_split_anywhere(cut):
    data = frames(*MSGS)
    check(feed(data, [cut, 2, 5] * (len(data) // 7 + 1)))


def test_large_parts_are_read_straight_into_their_own_buffer():
    big = bytes(random.Random(0).randbytes(3 << 20))  # larger than the 64 KiB read buffer
    msg = m.Push(9, seal({"big": bytearray(big)}))
    data = frames(m.Ping(1), msg, m.Ping(2))
    for sizes in ([len(data)], [100] * 10 + [70_000, 1], [1] * 40):
        got = feed(data, sizes)
        assert [type(x) for x in got] == [m.Ping, m.Push, m.Ping]
        assert unseal(got[1].values)["big"] == big


def test_random_chunkings_agree():
    data = frames(*MSGS)
    rng = random.Random(42)
    for _ in range(50):
        check(feed(data, [rng.randint(1, 5000) for _ in range(len(data))]))
