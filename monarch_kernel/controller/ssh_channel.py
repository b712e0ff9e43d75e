"""The framed protocol on an SSH channel: the agent's stdout carries frames to the controller, its
stderr goes to the host's log, and the controller writes frames to its stdin."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import ConnectionClosed
from monarch_kernel.wire.transport import FrameProtocol, encode


class ChannelConnection:
    """Framed messages over the agent's SSH channel (the interface of AsyncConnection).

    The session hands each packet of the agent's stdout straight to the frame reader (no
    stream reader task in between: one wake-up less per message).
    """

    def __init__(self, channel, session, on_message: Callable[[Any], None],
                 on_close: Callable[[Exception | None], None]):
        self._channel = channel
        self._session = session
        self._closed = False
        self._protocol = FrameProtocol(on_message, on_close)
        session.attach(self._protocol)
        self.bytes_sent = 0  # what send() has queued in all

    @property
    def last_received(self) -> float:
        """When bytes last arrived (time.monotonic()), complete frame or not."""
        return self._protocol.last_received

    def backlog(self) -> int:
        """Bytes queued for the agent that SSH has not sent yet (its flow control holds them)."""
        return self._channel.get_write_buffer_size()

    def send(self, msg: Any) -> None:
        """Queue one message (never blocks; asyncssh buffers and flow-controls)."""
        self.send_chunks(encode(msg))

    def send_chunks(self, chunks: list) -> None:
        """Queue an already encoded frame."""
        if self.closed:
            raise ConnectionClosed("the SSH channel is closed")
        data = b"".join(chunks) if len(chunks) > 1 else bytes(chunks[0])
        self.bytes_sent += len(data)
        try:
            self._channel.write(data)
        except BrokenPipeError as exc:  # the agent's side closed first: asyncssh has not told our session yet
            raise ConnectionClosed(f"the SSH channel is closed ({exc})") from None

    def close(self) -> None:
        """Close the channel (the agent sees end of input and exits)."""
        self._closed = True
        self._channel.close()

    @property
    def closed(self) -> bool:
        """Whether the channel is closed."""
        return self._closed or self._session.lost.done()


_SESSION_TYPE: Any = None


def agent_session(stderr_path: str) -> Any:
    """A session for the agent's channel (its class made on first use: asyncssh loads lazily)."""
    global _SESSION_TYPE
    if _SESSION_TYPE is None:
        import asyncssh

        class AgentSession(asyncssh.SSHClientSession):
            """stdout: frames for the controller; stderr: appended to the host's log."""

            def __init__(self, path: str):
                self._log = open(path, "ab")
                self.stderr_tail: collections.deque = collections.deque(maxlen=30)
                self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
                self._protocol: FrameProtocol | None = None
                self._early: list[bytes] = []

            def attach(self, protocol: FrameProtocol) -> None:
                self._protocol = protocol
                for data in self._early:
                    protocol.data_received(data)
                self._early.clear()
                if self.lost.done():
                    protocol.connection_lost(self.lost.result())

            def data_received(self, data: bytes, datatype) -> None:
                if datatype == asyncssh.EXTENDED_DATA_STDERR:
                    if not self._log.closed:
                        self._log.write(data)
                        self._log.flush()
                    self.stderr_tail.extend(
                        line for line in data.decode("utf-8", "replace").splitlines() if line.strip())
                elif self._protocol is not None:
                    self._protocol.data_received(data)
                else:
                    self._early.append(data)

            def connection_lost(self, exc: Exception | None) -> None:
                self._log.close()
                if not self.lost.done():
                    self.lost.set_result(exc)
                    if self._protocol is not None:
                        self._protocol.connection_lost(exc)

        _SESSION_TYPE = AgentSession
    return _SESSION_TYPE(stderr_path)
