"""An agent's link offer (`agent/direct_link.offer`) run in a thread on the pipes a job step or a Ray slot
gives it, and the client side's small helpers: what the Slurm and Ray link tests share."""

from __future__ import annotations

import os
import socket
import threading

from monarch_kernel.agent import direct_link


class OfferThread:
    """The offer in a thread; `line` is its first line, split (`direct IP PORT KEY`, `stdio KEY`, ...)."""

    def __init__(self, address: str | None = "127.0.0.1", make=None):
        self.to_agent_r, self.to_agent_w = os.pipe()
        self.from_agent_r, self.from_agent_w = os.pipe()
        self.result: list = []
        self.thread = threading.Thread(target=self._run, args=(address, make), daemon=True)
        self.thread.start()
        self.line = direct_link.read_line(self.from_agent_r).decode().split()
        if self.line[0] == "direct":
            self.address, self.port = self.line[1], int(self.line[2])

    def _run(self, address: str | None, make) -> None:
        try:
            args = (self.to_agent_r, self.from_agent_w, address) + ((make,) if make is not None else ())
            link = direct_link.offer(*args)
            self.result.append((link, link.read_environment(self.to_agent_r)))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.result.append(exc)

    def outcome(self):
        """(the link, the environment it read), or the exception the offer ended with."""
        self.thread.join(15)
        assert not self.thread.is_alive()
        return self.result[0]

    def close(self) -> None:
        for fd in (self.to_agent_r, self.to_agent_w, self.from_agent_r, self.from_agent_w):
            os.close(fd)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset: it closed with our bytes unread) without a word."""
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True
