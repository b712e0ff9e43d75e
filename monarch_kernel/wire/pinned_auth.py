"""A link keyed by public keys that a scheduler carried both ways: the agents of a Ray mesh.

On a Ray cluster the controller reaches a node only through Ray (actor arguments and results go
over Ray's own gRPC channels, authenticated by Ray's token, encrypted only where the cluster turned
on TLS). So nothing secret travels there: each side makes an ephemeral X25519 key pair and only
the public halves cross Ray, the controller's as the agent's start argument, the agent's in its
offer (`direct IP PORT KEY`, returned from the Ray actor that started it):

    controller -> agent (Ray)    X_c                    agent -> controller (Ray)   X_a
    controller -> agent (TCP)    X_c | 32 | P           P = HMAC(K_join, "join" | T)
    K_join, keys = HKDF(X25519, salt = T, info = label | T),  T = SHA256(X_a | X_c)

The agent accepts a join only with the very key it was started with and a proof P that only the
holder of the controller's private half can make (a reader of Ray's traffic knows X_c too: without
P it could take the agent's one join and so stop the start). Every later record is AES-GCM under
keys that only the holders of the two private halves can compute: whoever answers in the agent's
place cannot read or forge one. What is trusted is Ray's delivery of the two public keys (someone
able to rewrite Ray's own traffic could swap them; Ray's TLS option closes that), the same trust
the cluster already gives Ray to run our code on its nodes.
"""

from __future__ import annotations

import hmac
import struct

from monarch_kernel.wire.link_crypto import (
    PUBLIC_BYTES,
    Ephemeral,
    RecordRefused,
    Session,
    derive_session,
    proof,
    transcript_hash,
)

LABEL = b"monarch-kernel pinned link v1"
JOIN_LABEL = b"monarch-kernel pinned link join v1"
_PROOF_LEN = struct.pack("!H", 32)  # (the join's shape is the munge link's: key, length, then the proof)


class PinnedKeyRefused(ConnectionError):
    """A join that did not carry the controller's key and proof, or an unusable key."""


def parse_public(text: str) -> bytes:
    """A public key from its hex form (PinnedKeyRefused if it is not one)."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise PinnedKeyRefused("a public key is not hex") from None
    if len(key) != PUBLIC_BYTES:
        raise PinnedKeyRefused(f"a public key has {len(key)} bytes, not {PUBLIC_BYTES}")
    return key


def _exchange(ours: Ephemeral, theirs: bytes, agent_public: bytes, controller_public: bytes) -> tuple[Session, bytes]:
    """The link's session and the join's proof."""
    transcript = transcript_hash(agent_public, controller_public)
    try:
        shared = ours.shared(theirs)
    except RecordRefused as exc:
        raise PinnedKeyRefused(str(exc)) from None
    join_key = derive_session(shared, transcript, JOIN_LABEL, transcript).down
    return derive_session(shared, transcript, LABEL, transcript), proof(join_key, b"join", transcript)


class PinnedOffer:
    """The agent's half: its key pair, and the controller's public key it was started with."""

    def __init__(self, controller_public: bytes):
        self.ephemeral = Ephemeral()
        self.controller_public = controller_public
        self.credential = self.ephemeral.public.hex().encode()  # what the offer line carries

    def accept(self, join: bytes) -> Session:
        """Check the controller's join and derive the session (raises PinnedKeyRefused)."""
        head = self.controller_public + _PROOF_LEN
        if len(join) != len(head) + 32 or not hmac.compare_digest(join[:len(head)], head):
            raise PinnedKeyRefused("the join does not carry the key this agent was started with")
        session, expected = _exchange(self.ephemeral, self.controller_public, self.ephemeral.public,
                                      self.controller_public)
        if not hmac.compare_digest(join[len(head):], expected):
            raise PinnedKeyRefused("the join's proof does not check out (not made by the controller)")
        return session


class PinnedJoin:
    """The controller's half: made before the agent starts (its public key goes along as an argument)."""

    def __init__(self) -> None:
        self.ephemeral = Ephemeral()
        self.public_hex = self.ephemeral.public.hex()

    def answer(self, agent_public: bytes) -> tuple[bytes, Session]:
        """The join to send and the link's keys, for the agent's public key in its offer (raises PinnedKeyRefused)."""
        session, join_proof = _exchange(self.ephemeral, agent_public, agent_public, self.ephemeral.public)
        return self.ephemeral.public + _PROOF_LEN + join_proof, session
