"""The Slurm step's link, authenticated by munge: what an onlooker of the cluster network cannot forge.

srun's I/O forwarding is neither private nor a place for a secret: whoever reads the cluster
network reads it. So the link between the kernel and a node's agent is keyed by an ephemeral
X25519 exchange (`wire/link_crypto.py`) whose public keys are bound to the user by munge, which
every node of a Slurm cluster runs (Slurm authenticates its own RPCs with it). A munge credential
says which uid made it and carries a payload, encrypted and MACed under the cluster's munge key,
decodable once (munged refuses replays), within its time to live, and here only by our own uid:

    agent  -> controller  (on srun's stdout)  CRED_a = munge(OFFER | X_a)
    controller -> agent   (TCP or stdin)      X_c, CRED_c = munge(JOIN | X_a | X_c)
    keys = HKDF(X25519, salt = T, info = label | T),  T = SHA256(X_a | X_c | CRED_a | CRED_c)

Each side checks that the other's credential decodes, was made by our own uid and carries
exactly the keys of this exchange. An onlooker of srun's I/O sees CRED_a and can neither read
the session (no private key) nor put its own key in the exchange (it would need a credential of
our uid); another user of the cluster gets credentials of its own uid, which are refused. Only
root on a node (who holds the munge key) is trusted, as Slurm itself trusts it.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from collections.abc import Callable

from monarch_kernel.wire.link_crypto import PUBLIC_BYTES, Ephemeral, RecordRefused, Session, derive_session, transcript_hash

OFFER_TAG = b"monarch-kernel step link offer v1|"
JOIN_TAG = b"monarch-kernel step link join v1|"
LABEL = b"monarch-kernel step link v1"
MAX_CREDENTIAL = 4096  # a credential for our small payloads is about 200 characters
MUNGE_TIMEOUT_S = 10.0
_CRED_LEN = struct.Struct("!H")


class MungeFailed(ConnectionError):
    """munge could not make or check a credential (missing, munged down, wrong user, replayed, expired)."""


def munge_socket() -> str | None:
    """munged's socket: `MONARCH_KERNEL_MUNGE_SOCKET`, else as Slurm is told to use it (`AuthInfo=socket=...`
    in slurm.conf), else None for munge's default."""
    if os.environ.get("MONARCH_KERNEL_MUNGE_SOCKET"):
        return os.environ["MONARCH_KERNEL_MUNGE_SOCKET"]
    path = os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    try:
        with open(path, encoding="utf-8", errors="replace") as conf:
            for line in conf:
                key, _, value = line.split("#", 1)[0].strip().partition("=")
                if key.strip().lower() == "authinfo":
                    found = re.search(r"(?:^|,)\s*socket=([^,\s]+)", value)
                    if found:
                        return found.group(1)
    except OSError:
        pass
    return None


def _run(tool: str, data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    path = shutil.which(tool)
    if path is None:
        raise MungeFailed(f"`{tool}` is not on PATH (install munge: Slurm meshes authenticate their link with it)")
    socket_path = munge_socket()
    command = [path, *(["--socket", socket_path] if socket_path else []), *args]
    try:
        return subprocess.run(command, input=data, capture_output=True, timeout=MUNGE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MungeFailed(f"`{tool}` did not run ({exc})") from None


def make_credential(payload: bytes) -> bytes:
    """A munge credential of our uid carrying payload, decodable only by our uid (raises MungeFailed)."""
    done = _run("munge", payload, f"--restrict-uid={os.getuid()}")
    credential = done.stdout.strip()
    if done.returncode != 0 or not credential.startswith(b"MUNGE:"):
        raise MungeFailed(f"munge could not make a credential: {done.stderr.decode(errors='replace').strip()}")
    return credential


def read_credential(credential: bytes) -> bytes:
    """The payload of a credential that our own uid made (raises MungeFailed otherwise)."""
    if not credential.startswith(b"MUNGE:") or len(credential) > MAX_CREDENTIAL:
        raise MungeFailed("not a munge credential")
    done = _run("unmunge", credential + b"\n")
    meta, sep, payload = done.stdout.partition(b"\n\n")
    fields = {k.strip(): v.strip().decode(errors="replace") for k, _, v in
              (line.partition(b":") for line in meta.splitlines())}
    status = fields.get(b"STATUS", "")
    if done.returncode != 0 or not sep or not status.startswith("Success"):
        why = status or done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
        raise MungeFailed(f"unmunge refused the credential: {why}")
    uid = re.search(r"\((\d+)\)\s*$", fields.get(b"UID", ""))
    if uid is None or int(uid.group(1)) != os.getuid():
        raise MungeFailed(f"the credential was made by uid {uid.group(1) if uid else '?'}, not by ours ({os.getuid()})")
    try:
        length = int(fields.get(b"LENGTH", b"-1"))
    except ValueError:
        length = -1
    if length != len(payload):
        raise MungeFailed("unmunge's payload has the wrong length")
    return payload


class Offer:
    """The agent's half: its key pair and the credential that binds the public key to our uid."""

    def __init__(self) -> None:
        self.ephemeral = Ephemeral()
        self.credential = make_credential(OFFER_TAG + self.ephemeral.public)

    def accept(self, join: bytes) -> Session:
        """Check the controller's join (`Join.message`) and derive the session (raises MungeFailed)."""
        if len(join) < PUBLIC_BYTES + _CRED_LEN.size:
            raise MungeFailed("the join is too short")
        theirs = join[:PUBLIC_BYTES]
        (length,) = _CRED_LEN.unpack_from(join, PUBLIC_BYTES)
        credential = join[PUBLIC_BYTES + _CRED_LEN.size:]
        if length != len(credential):
            raise MungeFailed("the join's credential has the wrong length")
        if read_credential(credential) != JOIN_TAG + self.ephemeral.public + theirs:
            raise MungeFailed("the join's credential is for another exchange (replayed or relayed)")
        return _session(self.ephemeral, theirs, self.ephemeral.public, theirs, self.credential, credential)


def read_join(read_exact: Callable[[int], bytes]) -> bytes:
    """One join message from a stream (`read_exact(n)` returns n bytes or raises)."""
    head = read_exact(PUBLIC_BYTES + _CRED_LEN.size)
    (length,) = _CRED_LEN.unpack_from(head, PUBLIC_BYTES)
    if length > MAX_CREDENTIAL:
        raise MungeFailed(f"a join announced a {length}-byte credential")
    return head + read_exact(length)


class Join:
    """The controller's half, made for one agent's offer (raises MungeFailed if the offer is not ours)."""

    def __init__(self, offer_credential: bytes):
        payload = read_credential(offer_credential)
        if not payload.startswith(OFFER_TAG) or len(payload) != len(OFFER_TAG) + PUBLIC_BYTES:
            raise MungeFailed("the agent's credential does not carry a link offer")
        agent_public = payload[len(OFFER_TAG):]
        ephemeral = Ephemeral()
        credential = make_credential(JOIN_TAG + agent_public + ephemeral.public)
        self.message = ephemeral.public + _CRED_LEN.pack(len(credential)) + credential
        self.session = _session(ephemeral, agent_public, agent_public, ephemeral.public, offer_credential, credential)


def _session(ours: Ephemeral, theirs: bytes, agent_public: bytes, controller_public: bytes, offer: bytes,
             join: bytes) -> Session:
    transcript = transcript_hash(agent_public, controller_public, offer, join)
    try:
        shared = ours.shared(theirs)
    except RecordRefused as exc:
        raise MungeFailed(str(exc)) from None
    return derive_session(shared, transcript, LABEL, transcript)
