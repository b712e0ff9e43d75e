"""The visual debugger inside a rank: debugpy's pydevd, linked to this process only, its Debug Adapter
Protocol traffic relayed to the notebook's debugger (JupyterLab's panels, through the kernel).

Nothing listens for others: pydevd connects to a socket this process opened on the loopback for the
moment it takes, and each side proves itself with a random token it alone holds (pydevd's own
`pydevdAuthorize` exchange: we send the token pydevd waits for, pydevd answers with the one we wait
for); a connection that cannot answer is closed. The tokens never leave the process.

Threads: `StartDebugger` runs on the main thread (pydevd traces the thread that starts it, and every
thread after); `rank-debug-relay` reads pydevd's messages and sends them up; the reader thread writes
the notebook's requests to pydevd (`to_debugger`), so the traffic flows while the main thread is
paused at a breakpoint. Our own threads that never run user code are marked untraced (`untraced`).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.wire.debugging import DebugFromRank, DebugToRank
from monarch_kernel.wire.ops import DebuggerStarted

CONNECT_WITHIN_S = 20.0  # pydevd's connection to our socket, and its answer to the authorization


def untraced(thread: threading.Thread) -> threading.Thread:
    """Mark one of our threads so the debugger never traces or stops it (no user code runs there)."""
    thread.pydev_do_not_trace = True  # type: ignore[attr-defined]  # pydevd's own mark
    return thread


class DapStream:
    """DAP messages over a socket: `Content-Length` headers, then JSON (the protocol's framing)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._write_lock = threading.Lock()

    def send(self, message: dict[str, Any] | str) -> None:
        """Write one message (a dict, or its JSON text)."""
        body = (message if isinstance(message, str) else json.dumps(message)).encode()
        with self._write_lock:
            self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def receive(self) -> str | None:
        """The next message's JSON text; None once the other side closed."""
        length = None
        while True:
            line = self._reader.readline()
            if not line:
                return None
            line = line.strip()
            if not line:
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            return None
        body = self._reader.read(length)
        return body.decode() if len(body) == length else None

    def close(self) -> None:
        """Close the socket (a reader waiting on it sees the end: shutdown wakes it, close alone does not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


class RankDebugger:
    """This rank's pydevd and the relay of its messages (one DAP session at a time)."""

    def __init__(self, rank: int, send: Callable[[Any], None]):
        self._rank = rank
        self._send = send
        self._stream: DapStream | None = None
        self._session: int | None = None

    @property
    def active(self) -> bool:
        """Whether the debugger runs here now."""
        return self._stream is not None

    def start(self, session: int) -> DebuggerStarted:
        """Start pydevd in this process (main thread) for `session`, linked to this process only."""
        if self._stream is not None and self._session == session:
            return DebuggerStarted(self._rank, os.getpid(), session)
        if self._stream is not None:
            self.stop()
        os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # (frozen stdlib modules: a warning per rank)
        try:
            import debugpy.server.api  # noqa: F401 - makes pydevd speak DAP (JSON)
            import pydevd  # (debugpy's vendored copy, importable once debugpy is)
        except ImportError as exc:
            raise RuntimeError(f"rank {self._rank} cannot debug: debugpy is not installed in its Python "
                               f"({exc}); pip install debugpy on that host") from None
        _show_tensors_briefly(self._rank)
        access, answer = secrets.token_hex(32), secrets.token_hex(32)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            listener.settimeout(CONNECT_WITHIN_S)
            found: list[DapStream] = []
            acceptor = untraced(threading.Thread(target=self._accept, args=(listener, access, answer, found),
                                                 name="rank-debug-accept", daemon=True))
            acceptor.start()
            pydevd.settrace(host="127.0.0.1", port=listener.getsockname()[1], suspend=False,
                            wait_for_ready_to_run=False, block_until_connected=True, access_token=access,
                            client_access_token=answer, patch_multiprocessing=False, notify_stdin=False,
                            trace_only_current_thread=False)
            acceptor.join(CONNECT_WITHIN_S)
        finally:
            listener.close()
        if not found:
            pydevd.stoptrace()
            raise RuntimeError(f"rank {self._rank}: the debugger did not connect within {CONNECT_WITHIN_S:.0f} s")
        self._stream, self._session = found[0], session
        untraced(threading.Thread(target=self._relay, args=(found[0], session), name="rank-debug-relay",
                                  daemon=True)).start()
        return DebuggerStarted(self._rank, os.getpid(), session)

    @staticmethod
    def _accept(listener: socket.socket, access: str, answer: str, found: list[DapStream]) -> None:
        """Take the first connection that proves it is our pydevd (it knows `answer`)."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the deadline passed, or the listener closed
                return
            stream = DapStream(conn)
            conn.settimeout(CONNECT_WITHIN_S)
            try:
                stream.send({"seq": 1, "type": "request", "command": "pydevdAuthorize",
                             "arguments": {"debugServerAccessToken": access}})
                reply = json.loads(stream.receive() or "{}")
            except (OSError, ValueError):
                reply = {}
            if secrets.compare_digest(str((reply.get("body") or {}).get("clientAccessToken") or ""), answer):
                conn.settimeout(None)
                found.append(stream)
                return
            stream.close()

    def _relay(self, stream: DapStream, session: int) -> None:
        while (text := stream.receive()) is not None:
            try:
                self._send(DebugFromRank(session, self._rank, text))
            except OSError:
                return

    def to_debugger(self, msg: DebugToRank) -> None:
        """Pass one DAP request on to pydevd (reader thread); answer a failure if none runs here."""
        stream = self._stream
        if stream is not None and msg.session == self._session:
            try:
                stream.send(_with_our_frames_hidden(msg.dap))
                return
            except OSError:
                pass
        request = json.loads(msg.dap)
        self._send(DebugFromRank(msg.session, self._rank, json.dumps({
            "type": "response", "seq": 0, "request_seq": request.get("seq", 0), "command": request.get("command"),
            "success": False, "message": f"rank {self._rank} has no debugger running (run the cell again)"})))

    def resume(self) -> None:
        """Let every paused thread run on (a stop is on its way to them)."""
        stream = self._stream
        if stream is not None:
            try:
                stream.send({"seq": 0, "type": "request", "command": "continue", "arguments": {"threadId": 0}})
            except OSError:
                pass

    def post_mortem(self) -> bool:
        """Stop this (main) thread at the error of the last failed cell, in the running debugger; returns
        when the notebook's debugger continues. False if no cell failed."""
        tb = getattr(sys, "last_traceback", None)
        if tb is None:
            return False
        if self._stream is None:
            raise RuntimeError(f"rank {self._rank} has no debugger running (turn on JupyterLab's debugger)")
        import pydevd

        debugger = pydevd.get_global_debugger()
        if debugger is None:
            raise RuntimeError(f"rank {self._rank}'s debugger has gone; run the command again")
        debugger.trigger_exception_handler((sys.last_type, sys.last_value, tb), as_uncaught=False)
        return True

    def stop(self) -> bool:
        """End the debugger here: threads run on untraced. Whether one was running."""
        stream, self._stream, self._session = self._stream, None, None
        if stream is None:
            return False
        import pydevd

        try:
            stream.send({"seq": 0, "type": "request", "command": "disconnect", "arguments": {}})
        except OSError:
            pass
        pydevd.stoptrace()
        stream.close()
        return True


def _show_tensors_briefly(rank: int) -> None:
    """Tensors in the variables panel and the debug console as dtype, shape, device (and a DTensor's
    piece and placements): pydevd's own rendering prints the values, slowly for a large one."""
    from _pydevd_bundle.pydevd_extension_api import StrPresentationProvider
    from _pydevd_bundle.pydevd_extension_utils import extensions_of_type

    from monarch_kernel.rank.tensorinfo import describe_local

    class TensorPresentation(StrPresentationProvider):
        def can_provide(self, type_object: type, type_name: str) -> bool:
            import torch

            return isinstance(type_object, type) and issubclass(type_object, torch.Tensor)

        def get_str(self, val: Any) -> str:
            try:
                return describe_local(val, rank, checksum=False).summary()
            except (TypeError, ValueError, RuntimeError, AttributeError) as exc:  # (a subclass we cannot read)
                return f"{type(val).__name__} ({exc})"

    providers = extensions_of_type(StrPresentationProvider)  # pydevd's own (loaded now), the list it keeps
    if not any(type(p).__name__ == "TensorPresentation" for p in providers):
        providers.insert(0, TensorPresentation())


def _with_our_frames_hidden(dap: str) -> str:
    """An `attach` request with rules that keep the debugger out of monarch_kernel's own frames and
    debugpy's (as they lie on this host), so stepping stays in the user's code."""
    request = json.loads(dap)
    if request.get("command") != "attach":
        return dap
    import debugpy

    import monarch_kernel

    ours = [os.path.dirname(os.path.abspath(module.__file__ or "")) for module in (monarch_kernel, debugpy)]
    arguments = request.setdefault("arguments", {})
    arguments["rules"] = [*arguments.get("rules", []), *({"path": path, "include": False} for path in ours)]
    return json.dumps(request)


def ensure_source_file(path: str, code: str) -> None:
    """Make the notebook's file name for a cell exist on this host too (the debugger matches breakpoints
    to files): written privately if missing, never through a link; left alone if it is there."""
    if os.path.lexists(path):
        return
    folder = os.path.dirname(path)
    missing = []
    while folder and not os.path.lexists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o700)
        except FileExistsError:
            pass  # another rank of this host made it just now (checked below like any other)
    info = os.lstat(os.path.dirname(path))
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"cannot place the cell's source at {path}: its folder is not ours")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return  # another rank of this host wrote it just now
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(code)
