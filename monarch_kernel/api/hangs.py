"""Why a cell hangs, in the notebook: `mesh.why()`, `mesh.stacks()`, the verdict a running cell
shows by itself when its ranks stop making progress, and the fresh process group after a stop
that had to end collectives in progress.

The ranks answer from their reader threads (rank/inspect.py); the verdict is core/hangs.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import html
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.api.sinks import OutputSink, default_sink
from monarch_kernel.controller.inspections import ANSWER_WITHIN_S
from monarch_kernel.controller.runtime import MeshRuntime
from monarch_kernel.controller.state import Request
from monarch_kernel.core.hangs import Frame, RankReport, Verdict, diagnose, grouped_stacks
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.wire import messages as m
from monarch_kernel.wire.calls import PendingCall
from monarch_kernel.wire.ops import NativeStacks, RemakeDefaultGroup

DEFAULT_HANG_S = 30.0  # `%mesh config hang SECONDS|off`
LOOK_EVERY_S = 5.0  # while a cell runs past its hang limit, its ranks are asked this often


class Diagnosis:
    """What `mesh.why()` returns: `str()` is the verdict; in a notebook it shows as HTML with the
    grouped stacks below it."""

    def __init__(self, verdict: Verdict, reports: dict[int, RankReport], *, all_threads: bool = False,
                 title: str = ""):
        self.verdict = verdict
        self.reports = reports
        self._all_threads = all_threads
        self._title = title

    @property
    def hung(self) -> bool:
        """Whether some rank waits in a collective that cannot finish as things stand."""
        return self.verdict.hung

    def stacks_text(self) -> str:
        """The grouped stacks table as text."""
        return stacks_text(self.reports, all_threads=self._all_threads)

    def __str__(self) -> str:
        return str(self.verdict)

    def text(self) -> str:
        """The verdict, then the stacks."""
        head = f"{self._title}\n" if self._title else ""
        return f"{head}{self.verdict}\n\n{self.stacks_text()}".rstrip()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        lines = "".join(f"<div><b>{html.escape(line)}</b></div>" for line in self.verdict.lines)
        title = f"<div>{html.escape(self._title)}</div>" if self._title else ""
        return (f"<div class='monarch-why'>{title}{lines}"
                f"<pre style='margin-top:0.5em'>{html.escape(self.stacks_text())}</pre></div>")


def why(runtime: MeshRuntime, ranks: tuple[int, ...], *, all_threads: bool = False,
        timeout: float = ANSWER_WITHIN_S) -> Diagnosis:
    """The verdict over `ranks` now, with their grouped stacks (ranks that do not answer within
    `timeout` are named as silent)."""
    reports, dead, silent = runtime.inspections.ask(ranks, all_threads=all_threads, timeout=timeout)
    return Diagnosis(diagnose(reports, ranks, dead, silent), reports, all_threads=all_threads,
                     title=paused_note(runtime, ranks))


def paused_note(runtime: MeshRuntime, ranks: tuple[int, ...]) -> str:
    """What to say of the ranks paused in JupyterLab's debugger ("" if none is): ranks waiting for them
    wait for the person at the debugger, not on a hang."""
    paused = runtime.debugging.paused(ranks)
    if not paused:
        return ""
    return (f"{'rank' if len(paused) == 1 else 'ranks'} {format_ranks(list(paused))} paused in the debugger; the "
            "other ranks wait where they need it (continue in the debugger's panel, or press stop)")


def stacks_text(reports: dict[int, RankReport], *, all_threads: bool = False) -> str:
    """Identical stacks once, with their ranks; the user's frames with their lines, library frames folded."""
    blocks = []
    for ranks, thread, frames in grouped_stacks(reports, all_threads=all_threads):
        who = f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(list(ranks))}"
        running = {reports[r].running for r in ranks} - {""}
        what = f", running {', '.join(sorted(running))}" if running and thread == "main" else ""
        blocks.append(f"{who} ({thread} thread{what})\n" + "\n".join("  " + line for line in _folded(frames)))
    return "\n".join(blocks)


def _folded(frames: tuple[Frame, ...]) -> list[str]:
    first_user = next((i for i, f in enumerate(frames) if f.user), None)
    if first_user is None:
        return ["(no code of yours: the rank waits for work)"] if frames else ["(no stack)"]
    lines: list[str] = []
    library: list[Frame] = []
    for frame in frames[first_user:]:
        if frame.user:
            if library:
                lines.append(_library_line(library))
                library = []
            lines.append(frame.text())
        else:
            library.append(frame)
    if library:
        lines.append(_library_line(library))
    return lines


def _library_line(frames: list[Frame]) -> str:
    innermost = frames[-1]
    package = _package_of(innermost.filename)
    return f"... {len(frames)} frame{'s' if len(frames) > 1 else ''} in {package} (innermost: {innermost.function})"


def _package_of(filename: str) -> str:
    parts = filename.replace(os.sep, "/").split("/")
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    for i, part in enumerate(parts):
        if part.startswith("python3"):
            return parts[i + 1].removesuffix(".py") if i + 1 < len(parts) else "python"
    return os.path.basename(filename)


class NativeStackText:
    """What `mesh.native_stacks()` returns: py-spy's dump per rank (native frames included)."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text)


def native_stacks(runtime: MeshRuntime, ranks: tuple[int, ...], timeout: float = 60.0) -> NativeStackText:
    """py-spy's native stacks of `ranks`, each host's agent running it on its own ranks."""
    states = runtime.state.ranks
    pids = {r: pid for r in ranks if r in states and states[r].alive and (pid := states[r].pid) is not None}
    links = [(link, tuple(pids[r] for r in link.ranks if r in pids)) for link in runtime.state.links]
    links = [(link, mine) for link, mine in links if mine]

    async def every() -> list[Any]:
        return await asyncio.gather(*(runtime.host_ops.send(link, NativeStacks(mine)) for link, mine in links),
                                    return_exceptions=True)

    answers = runtime.controller.run(every()).result(timeout)
    by_pid = {pid: r for r, pid in pids.items()}
    blocks = []
    for (link, _), answer in zip(links, answers):
        if isinstance(answer, BaseException):
            blocks.append(f"host {link.name}: {answer}")
        elif answer.missing:
            blocks.append(answer.missing)
        else:
            blocks += [f"rank {by_pid[pid]} (pid {pid}, host {link.name})\n{text.rstrip()}"
                       for pid, text in sorted(answer.stacks.items())]
    return NativeStackText("\n\n".join(blocks) or "no live rank to look at")


# ---------------------------------------------------------------- a running cell that stops making progress


class HangWatch:
    """Looks at the ranks of a running cell or actor call once it has run `hang_s`, then every
    LOOK_EVERY_S, and has the waiting thread show the verdict (`tick(show)`: show(text, html)) while
    they make no progress; the looks run on a helper thread, so the waiting thread keeps pumping output.
    (It holds nothing of the future that waits: a cycle would keep a pulled value's shared memory from
    being reused.)"""

    def __init__(self, runtime: MeshRuntime, ranks: tuple[int, ...], done: Callable[[], bool], label: str,
                 hang_s: float | None):
        self._runtime = runtime
        self._ranks = tuple(sorted(ranks))
        self._done = done
        self._label = label
        self._hang_s = hang_s
        self._started = time.monotonic()
        self._next_look = self._started + (hang_s or 0.0)
        self._looking = False
        self._last: tuple[int, tuple[str, ...]] | None = None  # (progress, stack tops) at the last look
        self._still_since = self._started  # when the figures last changed
        self.shown = ""  # the verdict shown, if any
        self._pending: tuple[str, str] | None = None  # a verdict for the waiting thread to show

    def tick(self, show: Callable[[str, str], None]) -> None:
        """Called by the waiting thread while it waits (it shows what the helper found: sinks are one thread's)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            show(*pending)
        if self._hang_s is None or self._looking or self._done() or time.monotonic() < self._next_look:
            return
        self._looking = True
        threading.Thread(target=self._look, name="mesh-hang-watch", daemon=True).start()

    def _look(self) -> None:
        """A cheap look (the groups' counters and the stacks); a full one (the flight recorder's
        entries: their collective, tensors and how long) only when the ranks may be stuck."""
        try:
            ranks = self._ranks
            text = paused_note(self._runtime, ranks)
            if text:  # not a hang: someone is stepping through a rank
                if text != self.shown:
                    self.shown = text
                    self._pending = (text, f"<div><b>{html.escape(text)}</b></div>")
                return
            light, dead, silent = self._runtime.inspections.ask(ranks, counters_only=True)
            if self._done():
                return
            now = time.monotonic()
            figures = (sum(r.progress() + sum(g.entered for g in r.groups) for r in light.values()),
                       tuple(f.text() if (f := light[r].user_frame()) else "" for r in sorted(light)))
            moved = self._last is not None and figures != self._last
            if self._last is None or moved:  # (the first look too: a cell busy in Python is not stuck yet)
                self._still_since = now
                self._last = figures
            waiting = any(g.waiting for r in light.values() for g in r.groups)
            quiet = now - self._still_since >= (self._hang_s or 0)
            if moved or not (waiting or quiet or dead or silent):
                return
            reports, dead, silent = self._runtime.inspections.ask(ranks)
            verdict = diagnose(reports, ranks, dead, silent)
            waited = max((g.for_s for r in reports.values() for g in r.groups if g.waiting), default=0.0)
            stuck = waited >= (self._hang_s or 0) if verdict.hung else quiet
            if stuck or dead or silent:
                text = str(verdict)
                if text != self.shown:
                    self.shown = text
                    diagnosis = Diagnosis(verdict, reports, title=f"no progress on the ranks of {self._label}:")
                    self._pending = (diagnosis.text(), diagnosis._repr_html_())
        finally:
            self._next_look = time.monotonic() + LOOK_EVERY_S
            self._looking = False


class CallWatch:
    """The same watch over an actor call the notebook waits on (see ControllerSender.wait_for_replies):
    its verdict goes to a sink of its own, made when there is one to show."""

    def __init__(self, runtime: MeshRuntime, pending: PendingCall):
        self._ranks = tuple(sorted(pending.ranks))
        self._label = pending.label
        self._watch = HangWatch(runtime, self._ranks, pending.done, f"the call {pending.label}",
                                runtime.inspections.hang_after_s)
        self._sink: OutputSink | None = None

    def tick(self) -> None:
        """Called by the waiting thread between its waits."""
        self._watch.tick(self._show)

    def _show(self, text: str, html: str) -> None:
        if self._sink is None:
            self._sink = default_sink(ranks=self._ranks, label=self._label)
        verdict = getattr(self._sink, "verdict", None)  # optional in OutputSink, like new_block
        if verdict is not None:
            verdict(text, html)
        else:
            self._sink.notice(self._ranks[0], text)

    def close(self) -> None:
        """The wait ended."""
        if self._sink is not None:
            self._sink.close()


def watch_call(runtime: MeshRuntime, pending: PendingCall) -> CallWatch | None:
    """A watch for an actor call the notebook waits on (None when the mesh's hang limit is off)."""
    return None if runtime.inspections.hang_after_s is None else CallWatch(runtime, pending)


# ---------------------------------------------------------------- after a stop that ended collectives


def remake_groups_after_stop(runtime: MeshRuntime, request: Request, timeout: float = 30.0) -> str | None:
    """If stopping `request` ended collectives on some ranks, every rank of the mesh makes a fresh
    default group; the one line that says so (None when nothing was ended, or another caller made it:
    then this one waits until it is made, so that nothing sent after it meets the broken group)."""
    if not request.aborted:
        return None
    first, made = request.claim_regroup()
    if not first:
        made.wait(timeout)
        return None
    try:
        return remake_default_groups(runtime, dict(request.aborted), f"remade/{request.req_id}", timeout)
    finally:
        made.set()


def regroup_after_interrupt(runtime: MeshRuntime, stopped: list[Request], grace: float) -> list[str]:
    """After an interrupt that nobody's wait made (%mesh interrupt, the sidebar's stop): wait up to `grace`
    for the `stopped` requests to end and make the group anew after each that ended collectives; what
    was said (one line each)."""
    deadline = time.monotonic() + grace
    lines = []
    for request in stopped:
        try:
            request.completion().result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            continue  # still running: whoever waits on it, or its own future, makes the group when it ends
        line = remake_groups_after_stop(runtime, request)
        if line is not None:
            lines.append(line)
    return lines


_regroups = itertools.count(1)


def regroup_after_stopped_calls(runtime: MeshRuntime, aborted: dict[int, str]) -> str | None:
    """The same after a stopped actor call whose endpoints were in collectives (`aborted`: rank -> how)."""
    return remake_default_groups(runtime, aborted, f"remade/call-{next(_regroups)}")


def remake_default_groups(runtime: MeshRuntime, aborted: dict[int, str], key: str,
                          timeout: float = 30.0) -> str | None:
    """Every rank of the mesh makes a fresh default group through the mesh's store (under `key`), after a
    stop ended collectives on the ranks of `aborted`; the one line that says so (None if none was)."""
    if not aborted:
        return None
    where = format_ranks(sorted(aborted))
    what = sorted(set(aborted.values()))[0]
    dead = sorted(r for r, state in runtime.state.ranks.items() if not state.alive)
    if dead:
        return (f"the stop ended collectives in progress on ranks {where} ({what}); with rank"
                f"{'s' if len(dead) > 1 else ''} {format_ranks(dead)} dead the process group cannot be made anew: "
                "%mesh restart (mesh.restart()) brings the mesh back")
    started = time.monotonic()
    remake = runtime.requests.submit(tuple(sorted(runtime.ranks)), lambda rid: m.RunOp(rid, RemakeDefaultGroup(key)),
                                     label="remake the process group")
    try:
        done = remake.completion().result(timeout)
    except TimeoutError:
        runtime.requests.stop(remake)
        return (f"the stop ended collectives in progress on ranks {where} ({what}), and the ranks did not make the "
                f"process group anew within {timeout:.0f} s (a rank still busy?); %mesh restart brings the mesh back")
    failed = {r: f.message for r, f in done.failures.items()}
    failed.update({r: res.failure.message for r, res in done.results.items() if res.failure is not None})
    if failed:
        return (f"the stop ended collectives in progress on ranks {where} ({what}), and making the process group "
                f"anew failed on ranks {format_ranks(sorted(failed))}: {next(iter(failed.values()))}; "
                "%mesh restart brings the mesh back")
    gone: set[str] = set()
    for result in done.results.values():
        if result.value is not None:
            from monarch_kernel.wire.serialization import unseal

            gone.update(unseal(result.value))
    line = (f"the stop ended collectives in progress on ranks {where} ({what}); the default process group was "
            f"made anew on every rank in {time.monotonic() - started:.1f} s")
    if gone:
        line += f"; process groups made in cells are gone ({', '.join(sorted(gone))}): make them again"
    return line
