"""Frames nobody should send: huge lengths, too many buffers, foreign pickles, half frames (F16, F9).

Each gets a clear FrameError, no large allocation, no code run, and the connection that
carried it is closed (lanes are reopened by the next call).
"""

import os
import pickle
import socket
import struct
import threading

import pytest

from monarch_kernel.wire import messages as m
from monarch_kernel.wire.safe_pickle import ForbiddenGlobal, loads
from monarch_kernel.wire.transport import BlockingConnection, FrameError, FrameProtocol, encode

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)

HEAD = struct.Struct("!II")
LEN = struct.Struct("!Q")


class Boom:
    """Unpickling this would create a file: proof that a foreign pickle ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def frame_of(meta: bytes, buffers=()) -> bytes:
    return HEAD.pack(len(meta), len(buffers)) + b"".join(LEN.pack(len(b)) for b in buffers) + meta + b"".join(buffers)


def feed_all(data: bytes):
    """Feed bytes to a FrameProtocol as asyncio would; returns (messages, close reasons)."""
    got, closed = [], []
    proto = FrameProtocol(got.append, closed.append)
    at = 0
    while at < len(data):
        buf = proto.get_buffer(-1)
        n = min(len(buf), len(data) - at)
        buf[:n] = data[at:at + n]
        proto.buffer_updated(n)
        at += n
    return got, closed, proto


BAD_FRAMES = {
    "a 1 GiB message announced by 8 bytes": HEAD.pack(1 << 30, 0),
    "an empty message": HEAD.pack(0, 0),
    "a million buffers": HEAD.pack(10, 1_000_000),
    "a buffer of 2**62 bytes": HEAD.pack(10, 1) + LEN.pack(1 << 62),
    "a pickle that is not one": frame_of(b"\x80\x05garbage that is not a pickle"),
    "a pickle of os.system": frame_of(pickle.dumps(os.system, protocol=5)),
    "a pickle of a function of ours": frame_of(pickle.dumps(loads, protocol=5)),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_a_bad_frame_closes_the_async_reader_with_a_clear_reason(name):
    good = b"".join(bytes(c) for c in encode(m.Ping(1)))
    got, closed, proto = feed_all(good + BAD_FRAMES[name] + good)
    assert got == [m.Ping(1)]  # the frame before it was read; nothing after it
    assert len(closed) == 1 and isinstance(closed[0], FrameError)
    assert "frame" in str(closed[0])
    assert len(proto.get_buffer(-1)) <= 1 << 16  # no buffer of the announced size was made
    proto.connection_lost(None)
    assert len(closed) == 1  # the reason is reported once


def test_a_foreign_pickle_runs_no_code(tmp_path):
    marker = tmp_path / "ran"
    got, closed, _ = feed_all(frame_of(pickle.dumps(Boom(str(marker)), protocol=5)))
    assert got == [] and isinstance(closed[0], FrameError) and not marker.exists()
    with pytest.raises(ForbiddenGlobal, match=r"io\.open"):
        loads(pickle.dumps(Boom(str(marker)), protocol=5), [])
    assert not marker.exists()


def test_the_runtimes_own_messages_still_pass():
    for chunked in (encode(m.Ping(7)), encode(m.Shutdown())):
        got, closed, _ = feed_all(b"".join(bytes(c) for c in chunked))
        assert closed == [] and len(got) == 1


@pytest.mark.parametrize("name", ["a 1 GiB message announced by 8 bytes", "a million buffers",
                                  "a buffer of 2**62 bytes", "a pickle of os.system"])
def test_a_bad_frame_on_a_blocking_connection_raises_frame_error(name):
    ours, theirs = socket.socketpair()
    conn = BlockingConnection(ours)
    try:
        writer = threading.Thread(target=theirs.sendall, args=(BAD_FRAMES[name],))
        writer.start()
        with pytest.raises(FrameError):
            conn.recv()
        writer.join(5)
    finally:
        conn.close()
        theirs.close()
