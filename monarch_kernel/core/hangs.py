"""Why a distributed cell hangs: what each rank reports of itself, and the verdict across ranks.

A rank answers an inspection from its reader thread, whatever its main thread does (a
`RankReport`: where the main thread is, and each process group's collective progress from
torch's flight recorder). `diagnose` compares the reports of a group's ranks by the
collectives' sequence numbers (`#58`: the 58th collective of that group since it was made):

- a straggler: some ranks wait in #N, others have not entered it (and where they are);
- a desync: ranks entered #N with different collectives;
- a dead rank that the others wait for;
- every rank inside #N and none finishing (the collective itself is stuck);
- no collective at all: every rank runs its own code (where).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monarch_kernel.core.ranksets import format_ranks

CELL_PREFIX = "<mesh "  # a notebook cell's code on a rank is compiled as "<mesh In[7]>"


@dataclass(frozen=True)
class Frame:
    """One frame of a stack (outermost first in a stack)."""

    filename: str
    lineno: int
    function: str
    line: str  # the source line ("" if unknown)
    user: bool  # the user's code (a cell, or a file outside Python's and installed packages' folders)

    @property
    def where(self) -> str:
        """`In[7] line 5` for a cell, else `file.py:12 in fn`."""
        if self.filename.startswith(CELL_PREFIX):
            return f"{self.filename[len(CELL_PREFIX):-1]} line {self.lineno}"
        return f"{self.filename}:{self.lineno} in {self.function}"

    def text(self) -> str:
        """Where, and the source line."""
        return f"{self.where}  {self.line.strip()}" if self.line.strip() else self.where


@dataclass(frozen=True)
class GroupProgress:
    """One process group's collectives on one rank (torch's flight recorder: sequence numbers)."""

    name: str  # torch's name of the group ("0": the default group)
    desc: str  # its description ("default_pg", or what group_desc= said)
    ranks: tuple[int, ...]  # its global ranks
    entered: int  # the last collective this rank entered (0: none yet)
    completed: int  # the last one that finished here
    op: str = ""  # the first unfinished collective's kind ("all_reduce"), if any
    what: str = ""  # its tensors ("4 floats")
    for_s: float = 0.0  # how long this rank has been in it

    @property
    def waiting(self) -> bool:
        """Inside a collective that has not finished here."""
        return self.entered > self.completed

    @property
    def label(self) -> str:
        """How a verdict names the group."""
        if self.name == "0" or self.desc == "default_pg":
            return "default group"
        named = f" {self.desc!r}" if self.desc and self.desc != "undefined" else ""
        return f"group{named} of ranks {format_ranks(self.ranks)}"


ENDPOINT_THREAD_PREFIX = "actor-"  # a rank's threads that run sync endpoints beside its main thread


@dataclass(frozen=True)
class RankReport:
    """What one rank says of itself when inspected."""

    rank: int
    running: str  # what runs ("In[7]", "Trainer.step"), "" when idle
    stack: tuple[Frame, ...]  # the main thread's, outermost first
    groups: tuple[GroupProgress, ...] = ()
    threads: tuple[tuple[str, tuple[Frame, ...]], ...] = ()  # endpoints' own threads; all others, when asked
    no_progress_info: str = ""  # why there are no collective figures ("" when there are)

    def user_frame(self) -> Frame | None:
        """The innermost frame of the user's own code on the main thread, else on an endpoint's thread."""
        endpoints = [frames for name, frames in self.threads if name.startswith(ENDPOINT_THREAD_PREFIX)]
        for stack in (self.stack, *endpoints):
            for frame in reversed(stack):
                if frame.user:
                    return frame
        return self.stack[-1] if self.stack else None

    def where(self) -> str:
        """`it is at In[7] line 5  time.sleep(60)` (or idle)."""
        frame = self.user_frame()
        if frame is None:
            return "it is idle" if not self.running else f"it runs {self.running}"
        return f"it is at {frame.text()}"

    def progress(self) -> int:
        """Collectives finished on this rank, all groups together (grows while it makes progress)."""
        return sum(g.completed for g in self.groups)


@dataclass
class Verdict:
    """The diagnosis: a few lines, the first of which says the most."""

    lines: list[str] = field(default_factory=list)
    hung: bool = False  # some rank waits in a collective that cannot finish as things stand

    def __str__(self) -> str:
        return "\n".join(self.lines)


def diagnose(reports: dict[int, RankReport], ranks: tuple[int, ...], dead: dict[int, str] | None = None,
             silent: tuple[int, ...] = ()) -> Verdict:
    """The verdict over `ranks`, from their reports; `dead`: rank -> how it died; `silent`: ranks
    that did not answer (a C call holding the GIL)."""
    dead = dead or {}
    verdict = Verdict()
    for group in _groups(reports):
        line = _group_verdict(group, reports, dead)
        if line:
            verdict.lines.append(line)
            verdict.hung = True
    if not verdict.lines:
        busy = [r for r in ranks if r in reports and reports[r].running]
        if busy:
            verdict.lines.append(f"no rank is inside a collective: {_where_ranks_are(reports, busy)}")
        else:
            verdict.lines.append(f"ranks {format_ranks(ranks)} are idle: nothing runs")
    if dead and not any("died" in line for line in verdict.lines):
        verdict.lines.append("; ".join(f"rank {r} died ({how})" for r, how in sorted(dead.items())))
    if silent:
        verdict.lines.append(f"{_ranks_word(silent)} did not answer: a C call may hold the GIL there "
                             "(`%mesh stacks --native` shows native stacks with py-spy)")
    return verdict


def _groups(reports: dict[int, RankReport]) -> list[GroupProgress]:
    """One GroupProgress per process group seen (any rank's), default group first."""
    seen: dict[str, GroupProgress] = {}
    for report in reports.values():
        for group in report.groups:
            seen.setdefault(group.name, group)
    return sorted(seen.values(), key=lambda g: (g.name != "0", g.name))


def _group_verdict(group: GroupProgress, reports: dict[int, RankReport], dead: dict[int, str]) -> str:
    """The verdict line for one group ("" when none of its ranks waits in a collective)."""
    mine = {r: next((g for g in reports[r].groups if g.name == group.name), _not_used_yet(group))
            for r in group.ranks if r in reports and not reports[r].no_progress_info}
    waiting = {r: g for r, g in mine.items() if g.waiting}
    if not waiting:
        return ""
    seq = min(g.completed + 1 for g in waiting.values())  # the collective the group is stuck at
    at_seq = {r: g for r, g in waiting.items() if g.completed + 1 == seq}
    ops: dict[str, list[int]] = {}
    for r, g in sorted(at_seq.items()):
        ops.setdefault(g.op or "a collective", []).append(r)
    if len(ops) > 1:  # desync: they called different collectives at the same point
        parts = [f"{_ranks_word(rs)} {op} ({_code_of(reports, rs)})" for op, rs in ops.items()]
        return f"the ranks of the {group.label} called different collectives at #{seq}: " + "; ".join(parts)
    op, in_it = next(iter(ops.items()))
    first = at_seq[in_it[0]]
    what = f"{first.what}, " if first.what else ""
    waited = max(g.for_s for g in at_seq.values())
    dead_members = sorted(r for r in group.ranks if r in dead)
    if dead_members:
        return (f"{_ranks_word(in_it)} wait in {op} #{seq} ({what}{group.label}) for "
                + ", ".join(f"rank {r}, which died ({dead[r]})" for r in dead_members))
    head = f"{_ranks_word(in_it)} wait in {op} #{seq} ({what}{group.label}) for {waited:.0f} s"
    behind = sorted(r for r in group.ranks if r not in at_seq and r in mine and mine[r].entered < seq)
    unknown = sorted(r for r in group.ranks if r not in mine and r not in dead)
    parts = [head]
    for r in behind:
        parts.append(f"rank {r} has not entered #{seq}: {reports[r].where()}")
    if unknown:
        parts.append(f"{_ranks_word(unknown)} did not say where {'it is' if len(unknown) == 1 else 'they are'}")
    if len(parts) == 1:
        parts.append("every rank of the group is inside it and none finishes: the collective itself is stuck "
                     "(a network problem, or a peer outside the mesh)")
    return "; ".join(parts)


def _not_used_yet(group: GroupProgress) -> GroupProgress:
    """A member's figures for a group it has not used yet (its flight recorder lists none)."""
    return GroupProgress(group.name, group.desc, group.ranks, 0, 0)


def _code_of(reports: dict[int, RankReport], ranks: list[int]) -> str:
    frame = reports[ranks[0]].user_frame()
    return frame.text() if frame is not None else "where unknown"


def _where_ranks_are(reports: dict[int, RankReport], ranks: list[int]) -> str:
    places: dict[str, list[int]] = {}
    for r in ranks:
        frame = reports[r].user_frame()
        places.setdefault(frame.text() if frame is not None else f"in {reports[r].running}", []).append(r)
    return "; ".join(f"{_ranks_word(rs)} at {where}" for where, rs in places.items())


def _ranks_word(ranks: list[int] | tuple[int, ...]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(list(ranks))}"


def grouped_stacks(reports: dict[int, RankReport], *, all_threads: bool = False,
                   ) -> list[tuple[tuple[int, ...], str, tuple[Frame, ...]]]:
    """Identical stacks once, with the ranks that have them: (ranks, thread name, frames)."""
    by_stack: dict[tuple[str, tuple[tuple[str, int, str], ...]], list[int]] = {}
    frames_of: dict[tuple[str, tuple[tuple[str, int, str], ...]], tuple[Frame, ...]] = {}
    for rank, report in sorted(reports.items()):
        stacks = [("main", report.stack)] + [(name, frames) for name, frames in report.threads
                                              if all_threads or name.startswith(ENDPOINT_THREAD_PREFIX)]
        for thread, frames in stacks:
            key = (thread, tuple((f.filename, f.lineno, f.function) for f in frames))
            by_stack.setdefault(key, []).append(rank)
            frames_of[key] = frames
    return [(tuple(ranks), key[0], frames_of[key]) for key, ranks in by_stack.items()]
