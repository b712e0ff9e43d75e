"""IPython's shell syntax in mesh cells, run on every rank: `!cmd`, `out = !cmd`, some magics.

The notebook's IPython rewrites the IPython syntax of a `%%mesh` cell into calls such as
`_mesh_shell.system('nvidia-smi')` before the cell is sent (see `core/shell_syntax.py`); on
each rank `_mesh_shell` is a RankShell. Commands run on the rank's host, their output
streamed live like prints, and an interrupt stops the whole command. The magics that
make sense on a rank are here (%pip, %env, %cd, %pwd, %time, %%time, %%bash, %%sh,
%%writefile); any other says so instead of failing obscurely. Ranks need no IPython.
"""

from __future__ import annotations

import os
import shlex
import signal
import string
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.core.errors import MeshUsageError

SHELL = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
STOP_GRACE_S = 2.0
LINE_MAGICS = ("pip", "env", "cd", "pwd", "time")
CELL_MAGICS = ("time", "bash", "sh", "writefile")


class RankShell:
    """What `!cmd` and `%magic` lines of a mesh cell call on a rank."""

    def __init__(self, namespace: dict[str, Any], run_cell: Callable[[str, str], Any]):
        self._ns = namespace
        self._run_cell = run_cell  # runs source like a cell (trailing expression -> value)

    # ------------------------------------------------------------ shell commands
    def system(self, cmd: str) -> None:
        """`!cmd`: run it, streaming its output (stderr too) into the rank's stdout."""
        self._ns["_exit_code"] = run_streaming(self._expand(cmd))

    def getoutput(self, cmd: str, split: bool = True, depth: int = 0) -> Any:
        """`out = !cmd`: its output, as a list of lines (or one string)."""
        proc = subprocess.run(self._expand(cmd), shell=True, executable=SHELL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        self._ns["_exit_code"] = proc.returncode
        text = proc.stdout.decode("utf-8", "replace")
        return text.splitlines() if split else text

    def _expand(self, cmd: str) -> str:
        """`{expr}` in a command is a Python expression on the rank, as in IPython."""
        try:
            return _Expander(self._ns).format(cmd)
        except Exception:  # noqa: BLE001 - braces meant for the shell (awk '{print $1}')
            return cmd

    # ------------------------------------------------------------ magics
    def run_line_magic(self, name: str, line: str, _stack_depth: int = 1) -> Any:
        """`%name line` for the magics a rank supports."""
        if name == "time":
            return self._timed(line, "<mesh %time>")
        line = self._expand(line)  # `{expr}` in the line, as IPython does for magics other than %time
        if name == "pip":
            self._ns["_exit_code"] = run_streaming(f"{shlex.quote(sys.executable)} -m pip {line}")
            return None
        if name == "env":
            return _env(line)
        if name == "cd":
            os.chdir(os.path.expanduser(line.strip() or "~"))
            print(os.getcwd())
            return None
        if name == "pwd":
            return os.getcwd()
        raise _unsupported("%", name, LINE_MAGICS)

    def run_cell_magic(self, name: str, line: str, cell: str) -> Any:
        """`%%name line` + cell, for the cell magics a rank supports."""
        if name == "time":
            return self._timed(cell, "<mesh %%time>")
        line = self._expand(line)
        if name in ("bash", "sh"):
            self._ns["_exit_code"] = run_streaming([SHELL if name == "bash" else "/bin/sh", "-c", cell])
            return None
        if name == "writefile":
            args = shlex.split(line)
            append = "-a" in args or "--append" in args
            paths = [a for a in args if not a.startswith("-")]
            if len(paths) != 1:
                raise MeshUsageError("%%writefile needs one file name, e.g. %%writefile [-a] config.yaml")
            path = os.path.expanduser(paths[0])
            print(f"{'Appending to' if append and os.path.exists(path) else 'Writing'} {path}")
            with open(path, "a" if append else "w", encoding="utf-8") as f:
                f.write(cell)
            return None
        raise _unsupported("%%", name, CELL_MAGICS)

    def _timed(self, source: str, filename: str) -> Any:
        started, cpu = time.perf_counter(), time.process_time()
        try:
            return self._run_cell(source, filename)
        finally:
            print(f"CPU time: {_duration(time.process_time() - cpu)}, "
                  f"wall time: {_duration(time.perf_counter() - started)}")


def run_streaming(cmd: str | list[str]) -> int:
    """Run a command (a string goes to the shell), copying its output to sys.stdout as it
    comes; returns its exit code. Ctrl-C (SIGINT on the rank) stops it and all it started.
    """
    shell = isinstance(cmd, str)
    proc = subprocess.Popen(cmd, shell=shell, executable=SHELL if shell else None, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None  # stdout=PIPE
    try:
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 1 << 16):
            sys.stdout.write(chunk.decode("utf-8", "replace"))
        return proc.wait()
    except BaseException:
        _stop_tree(proc)
        raise
    finally:
        proc.stdout.close()


def _stop_tree(proc: subprocess.Popen) -> None:
    """SIGINT the command and its descendants, then SIGKILL what is left after a grace."""
    tree = [proc.pid, *_descendants(proc.pid)]
    for signum in (signal.SIGINT, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, signum)
            except OSError:
                pass
        try:
            proc.wait(STOP_GRACE_S)
            if not [p for p in tree[1:] if _alive(p)]:
                return
        except subprocess.TimeoutExpired:
            pass


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _Expander(string.Formatter):
    def __init__(self, namespace: dict[str, Any]):
        self._ns = namespace

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        if not field_name or field_name.isdigit():  # `find -exec ls {} \;`: braces for the shell
            raise KeyError(field_name)
        return eval(field_name, self._ns), field_name  # noqa: S307 - the user's own cell, on their rank


def _env(line: str) -> Any:
    line = line.strip()
    if not line:
        return dict(os.environ)
    if "=" in line or " " in line:
        key, _, value = line.partition("=") if "=" in line else line.partition(" ")
        os.environ[key.strip()] = value.strip()
        print(f"env: {key.strip()}={value.strip()}")
        return None
    return os.environ.get(line)


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _unsupported(prefix: str, name: str, supported: tuple[str, ...]) -> MeshUsageError:
    return MeshUsageError(
        f"{prefix}{name} is not available in mesh cells: ranks run Python, not IPython. On ranks you can use "
        f"!shell commands and {', '.join(prefix + m for m in supported)}; run {prefix}{name} in a cell without "
        "%%mesh to use it in the notebook")
