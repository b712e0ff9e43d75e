"""A Slurm step's link: keyed by munge credentials (real munged), encrypted, over TCP or the step's pipes.

srun's stdio is readable on the cluster network, so the tests play that onlooker: whatever crossed
the wire in clear (the offer line, the join, every record) must neither reveal nor let anyone use
what the link carries.
"""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import pytest
from mungelab import PrivateMunged, unavailable_reason
from offer_thread import OfferThread, closed_by_peer, connect

from monarch_kernel.agent import direct_link
from monarch_kernel.wire.link_crypto import DOWN, UP, Opener, RecordRefused, Sealer
from monarch_kernel.wire.munge_auth import JOIN_TAG, OFFER_TAG, Join, MungeFailed, munge_socket

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
ENV = {"WANDB_API_KEY": "not-for-the-network-" + os.urandom(8).hex()}


@pytest.fixture(scope="module", autouse=True)
def munged():
    folder = tempfile.mkdtemp(prefix="mk-munge-")  # (munge must reach its folder: not under pytest's 0700 one)
    try:
        with PrivateMunged(os.path.join(folder, "munge")) as daemon:
            os.environ["MONARCH_KERNEL_MUNGE_SOCKET"] = daemon.socket
            try:
                yield daemon
            finally:
                os.environ.pop("MONARCH_KERNEL_MUNGE_SOCKET", None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def credential_as(uid: int, payload: bytes) -> bytes:
    """A munge credential made by another user (uid) of this machine, as an attacker would make one."""
    done = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "munge",
                           "--socket", munge_socket()], input=payload, capture_output=True, check=True)
    return done.stdout.strip()


class Offer(OfferThread):
    """A munge offer in a thread; `credential` is what its line carries."""

    def __init__(self, address: str | None = "127.0.0.1"):
        super().__init__(address)
        self.credential = self.line[-1].encode()


def first_bytes(join: Join, env: dict) -> tuple[bytes, Sealer, Opener]:
    sealer, opener = Sealer(join.session.keys_for(DOWN)[0]), Opener(join.session.keys_for(DOWN)[1])
    return join.message + b"".join(sealer.seal([json.dumps(env).encode()])), sealer, opener


def test_only_a_join_of_our_uid_gets_in_and_the_port_closes_behind_it():
    offer = Offer()
    try:
        with connect(offer.port) as stranger:  # junk: dropped
            stranger.sendall(os.urandom(300))
            assert closed_by_peer(stranger)
        # another user of the cluster binds its own key to the agent's: its uid gives it away
        with connect(offer.port) as other_user:
            from monarch_kernel.wire.link_crypto import Ephemeral

            theirs = Ephemeral().public
            cred = credential_as(65534, JOIN_TAG + b"\0" * 32 + theirs)
            other_user.sendall(theirs + len(cred).to_bytes(2, "big") + cred)
            assert closed_by_peer(other_user)
        join = Join(offer.credential)
        data, _, _ = first_bytes(join, ENV)
        with connect(offer.port) as controller:
            controller.sendall(data)
            link, env = offer.outcome()
            assert env == ENV and link.sock is not None
            link.sock.close()
        with pytest.raises(ConnectionRefusedError):  # nothing listens any more
            connect(offer.port)
    finally:
        offer.close()


def test_an_offer_made_by_another_user_is_refused_by_the_controller():
    from monarch_kernel.wire.link_crypto import Ephemeral

    forged = credential_as(65534, OFFER_TAG + Ephemeral().public)
    with pytest.raises(MungeFailed, match="uid 65534"):
        Join(forged)


def test_a_join_recorded_on_the_wire_opens_no_other_offer():
    first, second = Offer(), Offer()
    try:
        join = Join(first.credential)
        data, _, _ = first_bytes(join, ENV)
        with connect(first.port) as controller:
            controller.sendall(data)
            _, env = first.outcome()
            assert env == ENV
        with connect(second.port) as replayer:  # the recorded join, to another agent
            replayer.sendall(data)
            assert closed_by_peer(replayer)
        os.write(second.to_agent_w, b"stdio\n" + data)  # the same recording on the second one's stdin
        assert "refused" in str(second.outcome())
    finally:
        first.close()
        second.close()


def test_a_controller_that_cannot_connect_joins_on_the_step_stdio():
    offer = Offer()
    try:
        data, _, _ = first_bytes(Join(offer.credential), ENV)
        os.write(offer.to_agent_w, b"stdio\n" + data)
        link, env = offer.outcome()
        assert link.sock is None and env == ENV
        with pytest.raises(ConnectionRefusedError):
            connect(offer.port)
    finally:
        offer.close()


def test_without_an_address_the_link_rides_the_pipes_encrypted():
    offer = Offer(address=None)
    try:
        assert offer.line[0] == "stdio"
        data, _, _ = first_bytes(Join(offer.credential), ENV)
        os.write(offer.to_agent_w, data)
        link, env = offer.outcome()
        assert link.sock is None and env == ENV
    finally:
        offer.close()


def test_forty_silent_connections_neither_fail_nor_delay_the_start():
    """N21: 32 silent connections during the offer made the start fail (the newcomer, the controller,
    was turned away)."""
    offer = Offer()
    silent = [connect(offer.port) for _ in range(40)]
    try:
        started = time.monotonic()
        data, _, _ = first_bytes(Join(offer.credential), ENV)
        with connect(offer.port) as controller:
            controller.sendall(data)
            link, env = offer.outcome()
        assert env == ENV
        assert time.monotonic() - started < direct_link.HANDSHAKE_S + 3  # not held behind the silent ones
        link.sock.close()
    finally:
        for sock in silent:
            sock.close()
        offer.close()


def test_an_agent_without_munge_says_why_and_the_controller_can_tell_the_user(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_MUNGE_SOCKET", "/nonexistent/munge.sock")
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    try:
        with pytest.raises(SystemExit):
            direct_link.offer(to_r, from_w, "127.0.0.1")
        assert direct_link.read_line(from_r).startswith(b"link refused ")
    finally:
        for fd in (to_r, to_w, from_r, from_w):
            os.close(fd)


def test_the_offer_names_the_numeric_address_it_bound():
    offer = Offer(address="localhost")
    try:
        assert offer.address in ("127.0.0.1", "::1")
        os.write(offer.to_agent_w, b"")
        data, _, _ = first_bytes(Join(offer.credential), ENV)
        os.write(offer.to_agent_w, b"stdio\n" + data)
        offer.outcome()
    finally:
        offer.close()


def test_the_controller_connects_only_to_the_literal_offered_and_never_to_a_loopback_of_another_machine():
    from monarch_kernel.controller.direct_join import direct_target

    assert direct_target(["198.18.0.5", "4242"], "node7") == ("198.18.0.5", 4242)
    assert direct_target(["127.0.0.1", "4242"], "127.0.0.1") == ("127.0.0.1", 4242)  # the node is this machine
    refused = direct_target(["127.0.1.1", "4242"], "198.18.0.5")  # Debian's `127.0.1.1 hostname` on the node
    assert isinstance(refused, str) and "loopback" in refused
    assert isinstance(direct_target(["4242"], "node7"), str)
    assert isinstance(direct_target(["node7", "4242"], "node7"), str)  # a name: never resolved here


def test_an_onlooker_of_everything_reads_nothing_and_injects_nothing():
    """N16 (High): frames were sealed but readable, and carried the persistent mesh's secret. Here a tap
    in the middle of the TCP link records every byte both ways; the secret, the environment and the
    message types are not in what it saw, and a record it writes into the stream closes the link."""
    from monarch_kernel.wire.persist_messages import Persist
    from monarch_kernel.wire.relay_link import RelayLink

    offer = Offer()
    secret = os.urandom(32)
    tapped = bytearray(offer.credential)  # the offer line crossed srun's stdio in clear
    tap = socket.create_server(("127.0.0.1", 0))
    tap_port = tap.getsockname()[1]
    inject: list[socket.socket] = []

    def relay(a: socket.socket, b: socket.socket) -> None:
        try:
            while chunk := a.recv(1 << 16):
                tapped.extend(chunk)
                b.sendall(chunk)
        except OSError:
            pass

    def middle() -> None:
        controller_side, _ = tap.accept()
        agent_side = connect(offer.port)
        inject.append(agent_side)
        for a, b in ((controller_side, agent_side), (agent_side, controller_side)):
            threading.Thread(target=relay, args=(a, b), daemon=True).start()

    threading.Thread(target=middle, daemon=True).start()
    join = Join(offer.credential)
    data, sealer, opener = first_bytes(join, ENV)
    controller = connect(tap_port)
    controller.sendall(data)
    link, env = offer.outcome()

    async def scenario():
        heard, closed = [], []
        link.sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=link.sock)
        RelayLink(reader, writer, (link.sealer, link.opener), UP, heard.append, closed.append)
        controller.setblocking(False)
        c_reader, c_writer = await asyncio.open_connection(sock=controller)
        ours = RelayLink(c_reader, c_writer, (sealer, opener), DOWN, lambda msg: None, lambda exc: None)
        ours.send(Persist(3600.0, "tcp:198.18.0.9", secret=secret, record="/records/keep.json", holder=None))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not heard and loop.time() < deadline:
            await asyncio.sleep(0.01)
        # the tap writes a record of its own (right header, a guess at the body) into the stream
        from monarch_kernel.wire.link_crypto import RECORD_HEADER

        inject[0].sendall(RECORD_HEADER.pack(40, 1) + os.urandom(40 + 16))
        while not closed and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return heard, closed

    heard, closed = asyncio.run(scenario())
    assert [type(x) for x in heard] == [Persist] and heard[0].secret == secret
    assert closed and "tag" in str(closed[0])  # the injected record closed the link; nothing was delivered
    seen = bytes(tapped)
    assert secret not in seen and secret.hex().encode() not in seen
    assert ENV["WANDB_API_KEY"].encode() not in seen
    assert b"Persist" not in seen and b"monarch_kernel" not in seen
    tap.close()
    offer.close()


def test_records_refuse_replay_reorder_and_truncation():
    from monarch_kernel.wire.link_crypto import RECORD_BYTES

    key = os.urandom(32)
    pieces = Sealer(key).seal([os.urandom(RECORD_BYTES), b"tail"])
    records = [pieces[i] + pieces[i + 1] for i in range(0, len(pieces), 2)]  # (header, then ciphertext and tag)
    assert len(records) == 2

    def opened(sequence):
        opener = Opener(key)
        return [opener.open(r[:5], r[5:]) for r in sequence]

    assert opened(records)[-1][1] is True
    for bad in ([records[1], records[0]], [records[0], records[0]]):
        with pytest.raises(RecordRefused):
            opened(bad)
    with pytest.raises(RecordRefused):  # a header that says "last" where it was not
        forged = bytearray(records[0])
        forged[4] = 1
        opened([bytes(forged)])
    with pytest.raises(RecordRefused, match="announced"):
        Opener.body_length((RECORD_BYTES + 1).to_bytes(4, "big") + b"\0")
