import asyncio
import socket
import threading

import torch

from monarch_kernel.serialization import seal, unseal
from monarch_kernel.transport import AsyncConnection, BlockingConnection, ConnectionClosed


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
        while len(got) < len(messages):
            await asyncio.sleep(0.01)
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
