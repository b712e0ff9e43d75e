"""`python -m monarch_kernel.planner.estimate_job`: a helper process that estimates layouts.

`estimate_layout` makes torch's fake process group the default group of its process, and a
plan's estimates should neither weigh on the notebook nor pay torch's import (seconds) once per
layout. So a helper imports torch and the planner once, then forks a child per layout: the child
runs the estimate (a fresh process state each time, as if started anew) and hands the
LayoutEstimate back through a pipe; a child that dies or runs past its time gives an estimate
whose `error` says so.

Frames on stdin and stdout are an 8-byte length and a pickle. The first frame in is the
notebook's sys.path (plain data, so that the payloads' functions can be imported by reference);
each later one a job: {"payload": cloudpickled {spec, batch, layout, per_module, device_type}, "layout": text,
"timeout": seconds}. Each job is answered with one pickled LayoutEstimate, in order; a job whose
layout is "" counts the model's FLOPs instead (a `flops.ModelFlops`, with the share per rank of
each of the payload's "layouts").

Each child also names the modules it imported (the model's library: transformers takes seconds), and
the helper imports them before the next fork, so that only a helper's first child pays for them.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import struct
import sys
import time
import traceback
import warnings
from typing import IO, Any

_LENGTH = struct.Struct(">Q")


def write_frame(stream: IO[bytes], data: bytes) -> None:
    """One frame: its length, then its bytes."""
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> bytes | None:
    """The next frame, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    return data if len(data) == length else None


def _estimate(payload: bytes) -> Any:
    import cloudpickle

    from monarch_kernel.planner.estimate import LayoutEstimate, estimate_layout
    from monarch_kernel.planner.layout import Layout

    job = cloudpickle.loads(payload)
    if not job["layout"]:
        from monarch_kernel.planner.flops import ModelFlops, count_flops

        try:
            layouts = [Layout.parse(text) for text in job.get("layouts", [])]
            return count_flops(job["spec"].make, job["batch"], job["spec"].loss, layouts)
        except Exception as exc:  # noqa: BLE001 - the plan says its step times lack the FLOPs, and why
            return ModelFlops(0.0, "", error=f"{type(exc).__name__}: {exc}")
    try:
        return estimate_layout(job["spec"], job["batch"], Layout.parse(job["layout"]),
                               per_module=job.get("per_module", False), device_type=job.get("device_type", "cuda"))
    except Exception as exc:  # noqa: BLE001 - the notebook shows why this layout could not be estimated
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
        return LayoutEstimate(job["layout"], error=f"{type(exc).__name__}: {exc}{where}{_hint(str(exc))}")


def _hint(message: str) -> str:
    """What to do about a failure whose cause the message alone does not say."""
    if "Expected inputs of BF16 type" in message:
        return (" -- this model's experts run torch's grouped matmul (transformers' default "
                "experts_implementation 'grouped_mm'), which takes bf16 only on GPUs: plan with precision='bf16' "
                "(FSDP layouts cast the experts' weights), build the model in bf16, or set "
                "config._experts_implementation = 'batched_mm'")
    return ""


def _in_child(payload: bytes, layout: str, timeout: float) -> bytes:
    """Run one estimate in a forked child; its pickled result (or an estimate naming the failure)."""
    from monarch_kernel.planner.estimate import LayoutEstimate

    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: estimate, write, leave without running the parent's exit handlers
        os.close(readable)
        status = 0
        before = set(sys.modules)
        try:
            result = _estimate(payload)
            data = pickle.dumps((result, [name for name in sys.modules if name not in before]))
            view = memoryview(data)
            while view:
                view = view[os.write(writable, view):]
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the loop
            traceback.print_exc()
            status = 1
        finally:
            os._exit(status)
    os.close(writable)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select([readable], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(readable, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(readable)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return pickle.dumps(LayoutEstimate(layout, error=f"the estimate ran past {timeout:.0f} s and was stopped"))
    if status != 0 or not chunks:
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}")
        return pickle.dumps(LayoutEstimate(layout, error=f"the estimate's process died ({how})"))
    result, imported = pickle.loads(b"".join(chunks))
    _import_for_later(imported)
    return pickle.dumps(result)


def _import_for_later(names: list[str]) -> None:
    """Import here what a child imported, so that the next children inherit it (see the module docstring)."""
    for name in names:
        if name in sys.modules or name.startswith("__"):
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that only imports in its own context stays the child's own
            continue


def main() -> None:
    """Serve jobs until stdin ends."""
    # the frames go on a private copy of fd 1; fd 1 itself becomes stderr before any user code runs, so that
    # what the model writes there (os.write(1, ...), os.system, C/C++ logging) cannot mix with the results
    source = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")
    setup = read_frame(source)
    if setup is None:
        return
    for path in reversed(pickle.loads(setup)["sys_path"]):  # before any payload names its modules
        if path not in sys.path:
            sys.path.insert(0, path)
    import monarch_kernel.planner.estimate  # noqa: F401 - imported once, inherited by every child

    while (frame := read_frame(source)) is not None:
        job = pickle.loads(frame)
        write_frame(out, _in_child(job["payload"], job["layout"], float(job["timeout"])))


if __name__ == "__main__":
    main()
