"""Where a host's worker listens (`run_worker_loop_forever`) and where a client dials it (`attach_to_workers`).

Monarch's forms: `ipc://PATH` (a Unix socket on this machine), `tcp://HOST:PORT`, `tcp://HOST:fdN`
(serve on a listening socket the process inherited as fd N; a client dials the real port), and the
alias `DIAL@BIND` (`tcp://node7:4444@tcp://0.0.0.0:4444`): a worker binds BIND, clients dial DIAL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WORKER_START_WAIT_S = 5.0  # how long a client retries a worker that refuses connections (it may be starting)
_TCP = re.compile(r"tcp://(\[[0-9a-fA-F:]+\]|[^:/@\[\]]+):(fd)?([0-9]+)")


class WorkerAddressError(ValueError):
    """An address that is none of the worker forms (the message shows them)."""


@dataclass(frozen=True)
class WorkerAddress:
    """One end point: a Unix socket `path`, or a TCP `host` and `port` (or inherited listening `fd`)."""

    text: str
    path: str | None = None
    host: str = ""
    port: int = 0
    fd: int | None = None

    @property
    def is_unix(self) -> bool:
        """Whether it is a Unix socket (this machine only)."""
        return self.path is not None


def _one(text: str) -> WorkerAddress:
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return WorkerAddress(text, path=text[len("ipc://"):])
    if text.startswith("unix:") and len(text) > len("unix:"):
        return WorkerAddress(text, path=text[len("unix:"):])
    match = _TCP.fullmatch(text)
    if match:
        host = match.group(1).strip("[]")
        if match.group(2):
            return WorkerAddress(text, host=host, fd=int(match.group(3)))
        return WorkerAddress(text, host=host, port=int(match.group(3)))
    raise WorkerAddressError(f"worker address {text!r}: use ipc://PATH, tcp://HOST:PORT, tcp://HOST:fdN, or "
                             "DIAL@BIND (tcp://node7:4444@tcp://0.0.0.0:4444)")


def dial_address(text: str) -> WorkerAddress:
    """Where a client connects for `text` (DIAL of an alias)."""
    found = _one(text.split("@", 1)[0])
    if found.fd is not None:
        raise WorkerAddressError(f"worker address {text!r}: tcp://HOST:fdN is how a worker serves an inherited "
                                 "socket; dial its port (tcp://HOST:PORT)")
    return found


def serve_addresses(text: str) -> tuple[WorkerAddress, WorkerAddress]:
    """(where the worker listens, what it calls itself) for `text` (BIND and DIAL of an alias)."""
    dial, _, bind = text.partition("@")
    return _one(bind or dial), _one(dial)


def not_answering(address: WorkerAddress, why: str) -> str:
    """What to say of a worker that cannot be reached (Monarch's words first, then ours)."""
    where = address.path if address.path is not None else f"{address.host}:{address.port}"
    return (f"attach failed: config push failed during attach: the worker at {address.text} ({where}) does not "
            f"answer ({why}); start it there with run_worker_loop_forever(address=...)")
