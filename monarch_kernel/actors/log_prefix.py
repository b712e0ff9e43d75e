"""Log records made by an actor name it, as Monarch's do: `[actor=<root>.<mod.Class name{'gpus': 0/2}>] message`.

`install()` puts a log-record factory in front of the process's own (once): a record made while an actor's
endpoint or constructor runs gets its actor's name before its message; in a client that uses Monarch's API
(`monarch_kernel.monarch.actor`, `client=True`), records made outside actors get `[actor=<root>] `. Records
with an empty message (torch.compile's structured traces) are left alone. Set `prefix_python_logs_with_actor`
(Monarch's `monarch.actor.config.prefix_python_logs_with_actor`) to False to stop it. Ranks install it with
their first actor, so a rank that only runs cells logs as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from monarch_kernel.actors.base import current_actor
from monarch_kernel.actors.identities import current_identity

prefix_python_logs_with_actor = True  # Monarch's switch (read for each record)

_lock = threading.Lock()
_installed = False
_client = False


def install(client: bool = False) -> None:
    """Prefix log records with the running actor from now on (`client`: also the root client's outside actors)."""
    global _installed, _client
    with _lock:
        _client = _client or client
        if _installed:
            return
        _installed = True
        make = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = make(*args, **kwargs)
        if prefix_python_logs_with_actor and made.msg and (_client or current_actor.get() is not None):
            made.msg = f"[actor={current_identity().qualified_name()}] {made.msg}"
        return made

    logging.setLogRecordFactory(record)
