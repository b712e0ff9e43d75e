"""A Ray node's agent link: keyed by public keys Ray carried, proved on the TCP join, encrypted.

Ray's channels may be readable on the cluster network, so the tests play a reader of them: it knows
both public keys (the controller's went to the agent as an argument, the agent's came back in its
offer) and must still neither get into the agent nor stop the controller from getting in.
"""

import io
import json
import os

import pytest
from offer_thread import OfferThread, closed_by_peer, connect

from monarch_kernel.wire.link_crypto import DOWN, UP, Opener, RecordRefused, Sealer, read_frame
from monarch_kernel.wire.pinned_auth import PinnedJoin, PinnedKeyRefused, PinnedOffer, parse_public

ENV = {"HF_TOKEN": "not-for-the-network-" + os.urandom(8).hex()}


class AgentOffer(OfferThread):
    """An agent's pinned offer in a thread, on the pipes a Ray slot gives it."""

    def __init__(self, controller_public: bytes):
        super().__init__("127.0.0.1", lambda: PinnedOffer(controller_public))
        assert self.line[0] == "direct"
        self.agent_public = parse_public(self.line[3])


def first_bytes(join: PinnedJoin, agent_public: bytes) -> bytes:
    message, session = join.answer(agent_public)
    sealer = Sealer(session.keys_for(DOWN)[0])
    return message + b"".join(sealer.seal([json.dumps(ENV).encode()]))


def test_a_reader_of_rays_traffic_neither_gets_in_nor_takes_the_controllers_place():
    controller = PinnedJoin()
    offer = AgentOffer(bytes.fromhex(controller.public_hex))
    try:
        public = bytes.fromhex(controller.public_hex)
        with connect(offer.port) as reader:  # it knows the controller's key, not the proof only its private half makes
            reader.sendall(public + (32).to_bytes(2, "big") + os.urandom(32))
            assert closed_by_peer(reader)
        with connect(offer.port) as reader:  # the key alone, as the unproved join shape
            reader.sendall(public + (0).to_bytes(2, "big"))
            assert closed_by_peer(reader)
        with connect(offer.port) as impostor:  # a controller of its own, with its own (valid) proof
            impostor.sendall(first_bytes(PinnedJoin(), offer.agent_public))
            assert closed_by_peer(impostor)
        with connect(offer.port) as ours:
            ours.sendall(first_bytes(controller, offer.agent_public))
            link, env = offer.outcome()
            assert env == ENV and link.sock is not None
            link.sock.close()
        with pytest.raises(ConnectionRefusedError):  # the one join was taken: nothing listens any more
            connect(offer.port)
    finally:
        offer.close()


def test_both_ends_derive_the_same_keys_and_nobody_else_does():
    controller = PinnedJoin()
    agent = PinnedOffer(bytes.fromhex(controller.public_hex))
    message, session = controller.answer(bytes.fromhex(agent.credential.decode()))
    assert agent.accept(message) == session
    stream = io.BytesIO(b"".join(Sealer(session.keys_for(DOWN)[0]).seal([b"cell"])))
    assert read_frame(stream.read, Opener(agent.accept(message).keys_for(UP)[1]), 1 << 20) == b"cell"
    stream.seek(0)
    with pytest.raises(RecordRefused):  # a third party's keys open nothing
        read_frame(stream.read, Opener(PinnedJoin().answer(bytes.fromhex(agent.credential.decode()))[1]
                                       .keys_for(UP)[1]), 1 << 20)
    other = PinnedOffer(bytes.fromhex(controller.public_hex))  # another agent, started with the same key
    with pytest.raises(PinnedKeyRefused, match="proof"):
        other.accept(message)  # the proof binds the agent's own key: a join made for one agent opens no other
    with pytest.raises(PinnedKeyRefused):
        parse_public("00" * 31)
