"""The direct link a Slurm node's agent offers: only a peer that proves the secret gets in."""

import os
import socket
import threading

import pytest

from monarch_kernel.agent import direct_link
from monarch_kernel.wire.direct_auth import AuthenticationFailed, new_secret, prove_controller


class Offer:
    """An agent's offer running in a thread, with the pipes a job step would give it."""

    def __init__(self, secret: bytes):
        self.to_agent_r, self.to_agent_w = os.pipe()
        self.from_agent_r, self.from_agent_w = os.pipe()
        self.result: list = []
        self.thread = threading.Thread(target=self._run, args=(secret,), daemon=True)
        self.thread.start()
        line = direct_link.read_line(self.from_agent_r)
        assert line.startswith(b"direct "), line
        self.port = int(line.split()[1])

    def _run(self, secret: bytes) -> None:
        try:
            self.result.append(direct_link.offer(self.to_agent_r, self.from_agent_w, "127.0.0.1", secret))
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
            prove_controller(controller, secret)
            agent = offer.outcome()
            assert isinstance(agent, socket.socket)
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


def test_strangers_knocking_end_the_offer_instead_of_listening_forever():
    offer = Offer(new_secret())
    try:
        for _ in range(direct_link.MAX_FAILED_PROOFS):
            with connect(offer.port) as stranger:
                stranger.recv(32)
        outcome = offer.outcome()
        assert isinstance(outcome, SystemExit) and "knocking" in str(outcome)
    finally:
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
