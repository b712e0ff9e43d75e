import asyncio
import socket
import threading

import pytest
import torch

from monarch_kernel.wire.serialization import seal, unseal
from monarch_kernel.wire.transport import AsyncConnection, BlockingConnection, ConnectionClosed

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def test_blocking_round_trip_with_big_buffers():
    a, b = socket.socketpair()
    left, right = BlockingConnection(a), BlockingConnection(b)
    payload = {"t": seal(torch.arange(3_000_000)), "n": 7}
    sender = threading.Thread(target=left.send, args=(payload,))
    sender.start()
    got = right.recv()
    sender.join()
    assert got["n"] == 7 and torch.equal(unseal(got["t"]), torch.arange(3_000_000))
    left.close()
    try:
        right.recv()
    except ConnectionClosed:
        pass
    else:
        raise AssertionError("recv after close should raise ConnectionClosed")


def test_async_side_receives_many_frames_in_order():
    a, b = socket.socketpair()
    blocking = BlockingConnection(b)
    messages = [("small", i) for i in range(200)] + [("big", seal(torch.ones(500_000)))]

    async def main():
        got, closed = [], asyncio.get_running_loop().create_future()
        conn = await AsyncConnection.from_socket(a, got.append, lambda exc: closed.set_result(exc))
        writer = threading.Thread(target=lambda: [blocking.send(m) for m in messages] and None)
        writer.start()
        async def all_in():
            while len(got) < len(messages):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_in(), 30)  # a lost frame fails here, not at the suite's timeout
        writer.join()
        conn.send(("reply", seal(torch.arange(10))))
        reply = await asyncio.to_thread(blocking.recv)
        blocking.close()
        await asyncio.wait_for(closed, 5)
        return got, reply

    got, reply = asyncio.run(main())
    assert [m[1] for m in got[:200]] == list(range(200))
    assert torch.equal(unseal(got[-1][1]), torch.ones(500_000))
    assert torch.equal(unseal(reply[1]), torch.arange(10))


def test_hot_messages_travel_as_flat_tuples_and_come_back_equal():
    import pickle

    import torch

    from monarch_kernel.wire import messages as m
    from monarch_kernel.wire.serialization import seal, unseal
    from monarch_kernel.wire.transport import _FLAT, _HEAD, decode, encode

    tensor = torch.arange(1 << 16, dtype=torch.float32)  # out of band: a buffer of its own
    call = m.ActorCall(3, 7, "echo", "ping", seal(((tensor,), {"k": 1})), (0, 2), True)
    gathered = m.Gathered(9, (m.Result(9, 0, seal("v"), None, 1.0, 2.0),
                              m.Result(9, 1, None, m.Failure("ValueError", "bad", "tb"), 1.0, 2.0)))
    for msg in (call, gathered, m.ToRanks((0, 1), m.RunCell(4, "x = 1", "<mesh In[1]>")),
                m.ToRanks((0,), m.Shutdown())):  # Shutdown itself is not flat: it rides along
        chunks = encode(msg)
        head = bytes(memoryview(chunks[0])[:_HEAD.size])
        meta_len, count = _HEAD.unpack(head)
        assert count & _FLAT  # sent flat
        nbufs = count & ~_FLAT
        start = _HEAD.size + 8 * nbufs
        meta = bytes(memoryview(chunks[0])[start:start + meta_len])
        if msg is call:
            assert b"monarch_kernel.wire.messages" not in meta  # no message class names in the frame
        back = decode(meta, [bytearray(c) for c in chunks[1:]], True)
        assert type(back) is type(msg)
        if msg is call:
            (got,), kwargs = unseal(back.args)
            assert torch.equal(got, tensor) and kwargs == {"k": 1} and back.ranks == (0, 2)
            assert len(chunks) == 2  # the tensor's bytes were not copied into the pickle
        elif msg is gathered:
            assert unseal(back.results[0].value) == "v" and back.results[1].failure.message == "bad"
        else:
            assert back == msg
    assert not (_HEAD.unpack(bytes(memoryview(encode(m.Shutdown())[0])[:_HEAD.size]))[1] & _FLAT)
    assert pickle.loads(pickle.dumps(call, protocol=5)).call_id == 7  # plain pickling still works


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def test_a_large_buffer_is_not_zero_filled_on_the_loop_when_its_header_arrives():
    """N22: each large buffer was a bytearray(size), zero-filled on the event loop as its header arrived (about a
    second per GiB of stall for the agent's and the controller's loops). It is now mapped lazily: memory is
    committed as bytes come, and a header alone commits nothing of what it names."""
    import struct

    from monarch_kernel.wire.transport import encode

    async def main():
        a, b = socket.socketpair()
        got, closed = [], []
        conn = await AsyncConnection.from_socket(a, got.append, closed.append)
        size = 512 << 20
        frame = encode(seal(torch.zeros(4)))  # a real header, then patched to announce one 512 MiB buffer
        head = bytes(frame[0])
        meta_len, count = struct.unpack_from("!II", head)
        assert count == 1
        patched = struct.pack("!II", meta_len, count) + struct.pack("!Q", size) + head[16:]
        before = _resident_bytes()
        sending = threading.Thread(target=b.sendall, args=(patched + b"\x01" * (1 << 20),), daemon=True)
        sending.start()  # the header and the first MiB of the buffer (a thread: the loop reads meanwhile)
        await asyncio.sleep(0.3)
        grown = _resident_bytes() - before
        b.close()
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.01)
        conn.close()
        return grown, got

    grown, got = asyncio.run(main())
    assert got == [] and grown < 64 << 20, f"{grown >> 20} MiB committed for a 512 MiB buffer that did not come"


def test_large_buffers_arrive_whole_and_writable():
    async def main():
        a, b = socket.socketpair()
        got: list = []
        conn = await AsyncConnection.from_socket(a, got.append, lambda exc: None)
        sender = BlockingConnection(b)
        value = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB
        threading.Thread(target=sender.send, args=(seal(value),), daemon=True).start()
        for _ in range(500):
            if got:
                break
            await asyncio.sleep(0.01)
        conn.close()
        b.close()
        return value, got

    value, got = asyncio.run(main())
    back = unseal(got[0])
    assert torch.equal(back, value)
    back += 1  # a writable tensor over the received memory
    assert int(back[0]) == 1
