"""The agent's end of a Slurm step's or Ray node's link: keys bound by munge (Slurm) or carried by Ray
(`wire/pinned_auth`), then a direct TCP link or the step's pipes.

srun's stdio is slow for bulk data and readable by anyone who reads the cluster network, so
nothing but public, bound values travels on it in clear (`wire/munge_auth`). The agent makes an
ephemeral key pair and a munge credential binding it to our uid, listens on the node's numeric
address when asked to, and says either `direct IP PORT CREDENTIAL` or `stdio CREDENTIAL` on
stdout. The controller joins with its own credential, over TCP or (after a `stdio` line) on
stdin; the first join that checks out wins, and the listener closes: no port of ours stays
open. Then the environment comes as the first encrypted frame, and everything after it as AES-GCM
records (`wire/relay_link.RelayLink`).

Strangers connecting to the listener are checked concurrently, each within HANDSHAKE_S, and at
most MAX_CHECKING at once: past that the oldest one is dropped, never the newcomer (who may be the
controller), so a crowd of silent connections neither delays nor fails the start. Refusals are
logged as one summary line per LOG_WINDOW_S.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from monarch_kernel.core.addresses import numeric_address
from monarch_kernel.wire.link_crypto import UP, Opener, RecordRefused, Sealer, Session, read_frame
from monarch_kernel.wire.munge_auth import Offer, read_join

OFFER_WAIT_S = 120.0  # the controller answers within its own connect timeout; this bounds a wedged one
HANDSHAKE_S = 2.0  # each connection sends its join within this (checked concurrently)
MAX_CHECKING = 32  # connections being checked at once; the oldest is dropped for a newcomer past it
LOG_WINDOW_S = 10.0
MAX_ENV_BYTES = 64 << 20


def read_line(fd: int, limit: int = 1 << 16) -> bytes:
    """One line from fd, a byte at a time (what follows belongs to the framed protocol); b"" at EOF."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return b""
        line += byte
        if len(line) > limit:
            raise SystemExit("monarch_kernel agent: a line on stdin is too long")
    return bytes(line)


def _log(text: str) -> None:
    print(f"monarch_kernel agent: {text}", file=sys.stderr, flush=True)


class StepLink:
    """What the handshake gave: the TCP socket (None: the step's pipes), and the link's record state."""

    def __init__(self, sock: socket.socket | None, session: Session):
        self.sock = sock
        self.sealer, self.opener = Sealer(session.keys_for(UP)[0]), Opener(session.keys_for(UP)[1])

    def read_environment(self, read_fd: int) -> dict[str, str]:
        """The first frame: the environment the ranks run with (JSON object of strings)."""
        sock = self.sock
        if sock is not None:
            sock.settimeout(OFFER_WAIT_S)
            read_exact: Callable[[int], bytes] = lambda n: _recv_exact(sock, n)  # noqa: E731
        else:
            read_exact = lambda n: read_fd_exact(read_fd, n)  # noqa: E731
        try:
            data = read_frame(read_exact, self.opener, MAX_ENV_BYTES)
        except (RecordRefused, OSError, EOFError) as exc:
            raise SystemExit(f"monarch_kernel agent: the environment did not arrive ({exc})") from None
        if self.sock is not None:
            self.sock.settimeout(None)
        return parse_environment(data)


class LinkOffer(Protocol):
    """The agent's half of a keyed exchange: munge's (`wire/munge_auth.Offer`) or pinned keys'
    (`wire/pinned_auth.PinnedOffer`, a Ray node's agent)."""

    credential: bytes  # what the offer line carries after the address

    def accept(self, join: bytes) -> Session:
        """The session of a join that checks out (raises ConnectionError otherwise)."""


def offer(read_fd: int, write_fd: int, address: str | None, make: Callable[[], LinkOffer] = Offer) -> StepLink:
    """Make the link (see the module's note): on the node's address if `address`, else on the pipes.

    make: the exchange's agent half (munge's by default)."""
    try:
        mine = make()
    except ConnectionError as exc:
        os.write(write_fd, f"link refused {exc}\n".encode())
        raise SystemExit(f"monarch_kernel agent: {exc}") from None
    credential = mine.credential.decode()
    listener = None
    if address:
        try:
            numeric = numeric_address(address)
            listener = socket.create_server((numeric, 0), family=socket.AF_INET6 if ":" in numeric else socket.AF_INET)
        except OSError as exc:
            _log(f"cannot listen on {address} ({exc}); staying on the step's stdio")
    if listener is None:
        os.write(write_fd, f"stdio {credential}\n".encode())
        return _join_on_stdin(read_fd, mine, expect_line=False)
    with listener:
        os.write(write_fd, f"direct {numeric} {listener.getsockname()[1]} {credential}\n".encode())
        return _wait_for_join(read_fd, listener, mine)


def _join_on_stdin(read_fd: int, mine: LinkOffer, *, expect_line: bool) -> StepLink:
    if expect_line and read_line(read_fd).strip() != b"stdio":
        raise SystemExit("monarch_kernel agent: the controller went away before joining")
    try:
        session = mine.accept(read_join(lambda n: read_fd_exact(read_fd, n)))
    except (OSError, EOFError) as exc:  # (MungeFailed and PinnedKeyRefused are ConnectionErrors)
        raise SystemExit(f"monarch_kernel agent: the controller's join on stdin was refused ({exc})") from None
    return StepLink(None, session)


class _Checks:
    """The connections being checked, oldest first; refusals counted and logged once per window."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: collections.OrderedDict[int, socket.socket] = collections.OrderedDict()
        self.refused = 0
        self.logged_at = 0.0
        self.last_why = ""

    def add(self, conn: socket.socket) -> None:
        with self.lock:
            while len(self.open) >= MAX_CHECKING:
                _, oldest = self.open.popitem(last=False)
                _shut(oldest)  # (its thread then fails its read and ends)
            self.open[id(conn)] = conn

    def done(self, conn: socket.socket) -> None:
        with self.lock:
            self.open.pop(id(conn), None)

    def refuse(self, peer: str, why: str) -> None:
        with self.lock:
            self.refused += 1
            self.last_why = f"{peer}: {why}"
            now = time.monotonic()
            if now - self.logged_at < LOG_WINDOW_S:
                return
            self.logged_at, count, self.refused = now, self.refused, 0
        _log(f"refused {count} connection(s) to the link's port in the last {LOG_WINDOW_S:.0f} s "
             f"(last: {self.last_why})")


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _wait_for_join(read_fd: int, listener: socket.socket, mine: LinkOffer) -> StepLink:
    wake_r, wake_w = socket.socketpair()
    joined: queue.SimpleQueue[StepLink] = queue.SimpleQueue()
    checks = _Checks()
    with wake_r, wake_w:
        deadline = time.monotonic() + OFFER_WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit("monarch_kernel agent: the controller neither connected nor chose stdio")
            ready, _, _ = select.select([listener.fileno(), read_fd, wake_r.fileno()], [], [], left)
            if wake_r.fileno() in ready:
                wake_r.recv(64)
                try:
                    link = joined.get_nowait()
                except queue.Empty:
                    pass
                else:
                    with checks.lock:
                        for conn in checks.open.values():
                            _shut(conn)
                    return link
            if read_fd in ready:
                return _join_on_stdin(read_fd, mine, expect_line=True)
            if listener.fileno() in ready:
                try:
                    conn, peer = listener.accept()
                except OSError as exc:  # (out of descriptors: the checks in flight free some)
                    checks.refuse("?", str(exc))
                    continue
                checks.add(conn)
                threading.Thread(target=_check, args=(conn, peer[0], mine, checks, joined, wake_w),
                                 name="direct-link-check", daemon=True).start()


def _check(conn: socket.socket, peer: str, mine: LinkOffer, checks: _Checks, joined: queue.SimpleQueue[StepLink],
           wake: socket.socket) -> None:
    """Check one connection's join (a thread each: a silent stranger delays nobody)."""
    try:
        conn.settimeout(HANDSHAKE_S)
        session = mine.accept(read_join(lambda n: _recv_exact(conn, n)))
    except (OSError, EOFError) as exc:  # (MungeFailed and PinnedKeyRefused are ConnectionErrors)
        checks.refuse(peer, str(exc) or type(exc).__name__)
        conn.close()
        return
    finally:
        checks.done(conn)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    joined.put(StepLink(conn, session))
    try:
        wake.send(b"!")
    except OSError:  # the offer ended meanwhile (another connection won)
        conn.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the other end closed the connection during the handshake")
        data += chunk
    return bytes(data)


def read_fd_exact(fd: int, n: int) -> bytes:
    """n bytes from a blocking descriptor (EOFError if it ends first)."""
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("stdin closed before all that was due arrived")
        data += chunk
    return bytes(data)


def parse_environment(data: bytes) -> dict[str, str]:
    """The environment the controller sent: a JSON object of strings (SystemExit saying what is wrong)."""
    try:
        env = json.loads(data)
    except ValueError:
        env = None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SystemExit("monarch_kernel agent: the environment is not a JSON object of strings")
    return env

