"""The direct link a Slurm node's agent offers: only a peer that proves the secret gets in."""

import os
import socket
import threading
import time

import pytest

from monarch_kernel.agent import direct_link
from monarch_kernel.wire.direct_auth import AuthenticationFailed, new_secret, prove_controller
from monarch_kernel.wire.ops import PutBegin


class Offer:
    """An agent's offer running in a thread, with the pipes a job step would give it."""

    def __init__(self, secret: bytes, address: str = "127.0.0.1"):
        self.address = address
        self.to_agent_r, self.to_agent_w = os.pipe()
        self.from_agent_r, self.from_agent_w = os.pipe()
        self.result: list = []
        self.thread = threading.Thread(target=self._run, args=(secret, address), daemon=True)
        self.thread.start()
        line = direct_link.read_line(self.from_agent_r)
        assert line.startswith(b"direct "), line
        self.address = line.split()[1].decode()  # the numeric address the agent bound
        self.port = int(line.split()[2])

    def _run(self, secret: bytes, address: str) -> None:
        try:
            self.result.append(direct_link.offer(self.to_agent_r, self.from_agent_w, address, secret))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.result.append(exc)

    def outcome(self):
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.result[0]

    def close(self) -> None:
        for fd in (self.to_agent_r, self.to_agent_w, self.from_agent_r, self.from_agent_w):
            os.close(fd)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_only_the_holder_of_the_secret_gets_in_and_the_port_closes_behind_it():
    secret = new_secret()
    offer = Offer(secret)
    try:
        with connect(offer.port) as stranger:  # sends junk: dropped
            stranger.recv(32)
            stranger.sendall(os.urandom(64))
            assert stranger.recv(64) == b""
        with connect(offer.port) as guesser, pytest.raises(AuthenticationFailed):
            prove_controller(guesser, new_secret())
        with connect(offer.port) as controller:
            session = prove_controller(controller, secret)
            agent, agent_session = offer.outcome()
            assert isinstance(agent, socket.socket) and agent_session == session and len(session) == 32
            agent.sendall(b"ping")
            assert controller.recv(4) == b"ping"
            agent.close()
        with pytest.raises(ConnectionRefusedError):  # nothing listens any more
            connect(offer.port)
    finally:
        offer.close()


def test_a_controller_that_cannot_connect_keeps_the_step_stdio():
    offer = Offer(new_secret())
    try:
        os.write(offer.to_agent_w, b"stdio\n")
        assert offer.outcome() is None
        with pytest.raises(ConnectionRefusedError):
            connect(offer.port)
    finally:
        offer.close()


def test_an_agent_that_cannot_prove_the_secret_is_refused_by_the_controller():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(os.urandom(32))
            conn.recv(64)
            conn.sendall(os.urandom(32))  # a proof made without the secret

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with connect(port) as sock, pytest.raises(AuthenticationFailed, match="agent's proof"):
        prove_controller(sock, new_secret())
    thread.join(5)
    listener.close()


def test_strangers_knocking_neither_end_the_offer_nor_delay_the_controller():
    """N10: 16 garbage connections ended the agent, and one silent connection held the
    controller for the full 5 s handshake timeout."""
    secret = new_secret()
    offer = Offer(secret)
    silent = [connect(offer.port) for _ in range(3)]  # they say nothing at all
    try:
        for _ in range(20):
            with connect(offer.port) as stranger:
                stranger.recv(32)
                stranger.sendall(os.urandom(64))
        started = time.monotonic()
        with connect(offer.port) as controller:
            prove_controller(controller, secret)
            assert time.monotonic() - started < 1.5  # the silent ones delayed nobody
            agent, _ = offer.outcome()
            agent.close()
    finally:
        for sock in silent:
            sock.close()
        offer.close()


def test_the_offer_names_the_numeric_address_it_bound():
    offer = Offer(new_secret(), address="localhost")
    try:
        assert offer.address in ("127.0.0.1", "::1")
        os.write(offer.to_agent_w, b"stdio\n")
        assert offer.outcome() is None
    finally:
        offer.close()


def test_the_controller_connects_only_to_the_literal_offered_and_never_to_a_loopback_of_another_machine():
    from monarch_kernel.controller.direct_join import direct_target

    assert direct_target(["198.18.0.5", "4242"], "node7") == ("198.18.0.5", 4242)
    assert direct_target(["127.0.0.1", "4242"], "127.0.0.1") == ("127.0.0.1", 4242)  # the node is this machine
    refused = direct_target(["127.0.1.1", "4242"], "198.18.0.5")  # Debian's `127.0.1.1 hostname` on the node
    assert isinstance(refused, str) and "loopback" in refused
    assert isinstance(direct_target(["4242"], "node7"), str)  # an older agent's offer: stdio
    assert isinstance(direct_target(["node7", "4242"], "node7"), str)  # a name: never resolved here
    assert direct_target(["none"], "node7") is None


def test_a_relay_of_the_handshake_cannot_inject_frames_afterwards():
    """N1 (High): the handshake proved the secret, but nothing bound it to the connection: a local user
    relaying it was then trusted by both ends, and injected HostOp frames the agent ran."""
    import asyncio

    from monarch_kernel.wire import messages as m
    from monarch_kernel.wire.relay_link import DOWN, UP, RelayLink
    from monarch_kernel.wire.transport import encode

    secret = new_secret()
    offer = Offer(secret)
    controller = connect(offer.port)
    session = prove_controller(controller, secret)
    agent_sock, agent_session = offer.outcome()

    async def scenario():
        heard, closed = [], []
        agent_sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=agent_sock)
        RelayLink(reader, writer, agent_session, UP, heard.append, closed.append)
        controller.setblocking(False)
        c_reader, c_writer = await asyncio.open_connection(sock=controller)
        ours = RelayLink(c_reader, c_writer, session, DOWN, lambda msg: None, lambda exc: None)
        ours.send(m.Ping(1))  # a sealed frame from the real controller: accepted
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not heard and loop.time() < deadline:
            await asyncio.sleep(0.01)
        # the relaying attacker writes a frame into the same connection, framed as a sealed one
        # (the next sequence number, the right length) but without the session key
        import struct

        frame = b"".join(bytes(c) for c in encode(m.HostOp(1, PutBegin("/tmp/pwned", 0))))
        c_writer.write(struct.pack("!QQ", 2, len(frame)) + os.urandom(32) + frame)
        while not closed and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return heard, closed

    heard, closed = asyncio.run(scenario())
    assert [type(x) for x in heard] == [m.Ping]  # nothing injected was delivered
    assert closed and "MAC" in str(closed[0])  # the link closed on the forged frame
    offer.close()


def test_a_secret_line_that_is_not_a_secret_is_refused():
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"abc\n")
        with pytest.raises(SystemExit, match="16 bytes"):
            direct_link.read_secret(read_fd)
    finally:
        os.close(read_fd)
        os.close(write_fd)
