"""Supervision, in the style of PyTorch Monarch: who hears that an actor mesh failed.

The owner of an actor mesh is whoever spawned it: an actor (inside one of its endpoints
or its constructor), or the notebook. When a rank of the mesh dies, or a broadcast to
it fails with nobody to tell, the owner hears a `MeshFailure`: an owning actor through
its `__supervise__(failure)` (a true result means handled), the notebook through
`unhandled_fault_hook(failure)`. A failure an actor does not handle (a false result, or
an exception from `__supervise__`) goes on to that actor's own owner, and so on up to
the notebook. In a program, as in Monarch, the default hook raises SystemExit and a hook that
raises ends the program: its main thread gets a KeyboardInterrupt, so it unwinds and exits
through the interpreter's own exit (its `atexit` handlers run). In a notebook (any IPython
shell) the default hook prints a report instead and the kernel keeps running: exiting would
lose everything the notebook holds.
"""

from __future__ import annotations

import _thread
import enum
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from monarch_kernel.core.failures import FailureKind, process_status_in_monarchs_words

FaultHook = Callable[["MeshFailure"], None]


class Owner(enum.StrEnum):
    """Who hears an actor mesh's failures (see the module's note)."""

    NOBODY = ""  # a handle made elsewhere, or Mesh.spawn's: failed broadcasts are printed
    NOTEBOOK = "notebook"  # its fault hook
    ACTOR = "actor"  # the actor that spawned it, through __supervise__
SUPERVISE = "__supervise__"  # called (like an endpoint) on the owner of an actor mesh that failed


@dataclass(frozen=True)
class MeshFailure:
    """What failed: the actor mesh (`mesh_name`), its rank, what happened and how it got here."""

    mesh_name: str  # the actor mesh's name, as given to spawn()
    actor_class: str
    rank: int | None
    kind: FailureKind  # DIED (its process or host is gone) or EXCEPTION (a broadcast call raised)
    message: str
    traceback: str = ""
    cause: MeshFailure | None = None  # the failure a supervisor was handling when it failed in turn
    unhandled_by: tuple[str, ...] = ()  # supervisors that returned a false value for it, innermost first
    actor: str = ""  # the failed actor's qualified name, as Monarch's: "<root>.<mod.Class name{'gpus': 1/2}>"

    @property
    def crashed_ranks(self) -> list[int]:
        """The failed ranks (Monarch's field): this one."""
        return [] if self.rank is None else [self.rank]

    def actor_label(self) -> str:
        """The failed actor's qualified name (or, unknown, its mesh, class and rank)."""
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return self.actor or f"<{self.actor_class} {self.mesh_name}>{where}"

    def report(self) -> str:
        """A readable report in Monarch's words: which actor failed, why, and who saw it unhandled."""
        return f"The actor {self.actor_label()} and all its descendants have failed:\n{self._details()}"

    def _details(self) -> str:
        status = process_status_in_monarchs_words(self.message) if self.kind == FailureKind.DIED else None
        lines = [f"  {self.message}"] if status is None else [f"  {status}:", f"  {self.message}"]
        if self.unhandled_by:
            lines.append(f"  not handled by: {', '.join(self.unhandled_by)}")
        if self.traceback:
            lines.append("  " + self.traceback.rstrip().replace("\n", "\n  "))
        if self.cause is not None:
            lines.append("while handling:\n  " + self.cause.report().replace("\n", "\n  "))
        return "\n".join(lines)

    def passed_over(self, supervisor: str) -> MeshFailure:
        """The same failure, noted as not handled by `supervisor`."""
        return MeshFailure(self.mesh_name, self.actor_class, self.rank, self.kind, self.message, self.traceback,
                           self.cause, (*self.unhandled_by, supervisor), self.actor)

    def __str__(self) -> str:
        return (f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, event=Supervision event: "
                f"actor {self.actor_label()} failed:\n{self._details()})")


def in_a_shell() -> bool:
    """Whether this process runs an IPython shell (a notebook's kernel, or IPython in a terminal)."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def default_fault_hook(failure: MeshFailure) -> None:
    """The default for a failure no actor handled. In a program, Monarch's: `sys.exit(1)`, which ends
    the program (see report_unhandled). In a notebook: print the report; the kernel keeps running."""
    if not in_a_shell():
        sys.exit(1)
    print(f"monarch_kernel: unhandled actor mesh failure (set monarch_kernel.monarch.actor.unhandled_fault_hook "
          f"to handle these)\n{failure.report()}", file=sys.stderr, flush=True)


_hook_source: list[Callable[[], FaultHook]] = []  # where the hook a program set is read (the Monarch API)
_ending: list[MeshFailure] = []  # the failure that ends this program (a hook raised; not in a shell)


def read_fault_hook_from(source: Callable[[], FaultHook]) -> None:
    """Where report_unhandled finds the notebook's hook from now on, read anew at each failure
    (`monarch_kernel.monarch.actor` registers its `unhandled_fault_hook`, which programs assign)."""
    _hook_source[:] = [source]


def report_unhandled(failure: MeshFailure) -> None:
    """Hand a failure nobody handled to the client's hook (the one a program set, if any). A hook that
    raises leaves the failure unhandled: it is reported, and a program ends (its main thread is
    interrupted, as Monarch's is, so it exits the normal way); a notebook's kernel goes on, and so does a
    program whose main thread has finished already (it is exiting: processes it stops or kills at its end
    must not turn a clean exit into an interrupted one)."""
    hook = _hook_source[0]() if _hook_source else default_fault_hook
    try:
        hook(failure)
    except BaseException as exc:  # noqa: BLE001 - whatever the hook raised, the failure is unhandled
        ending = not in_a_shell() and threading.main_thread().is_alive()  # (not once the program is ending)
        print(f"Unhandled monarch error on the root actor, hostname={socket.gethostname()}, PID={os.getpid()} "
              f"at time {datetime.now()}:\n{failure.report()}\n"
              f"(unhandled_fault_hook raised {type(exc).__name__}: {exc}; "
              f"{'the program ends' if ending else 'the kernel goes on'})", file=sys.stderr, flush=True)
        if ending:
            _ending.append(failure)
            _thread.interrupt_main()  # a KeyboardInterrupt on the main thread: it unwinds, atexit handlers run


def program_ending() -> KeyboardInterrupt | None:
    """The interrupt that ends this program because a failure was not handled (see report_unhandled), or
    None: a wait that it interrupts raises it as it is, and stops nothing (it is not the user's Ctrl-C)."""
    if not _ending:
        return None
    return KeyboardInterrupt(f"the program ends: an actor mesh failure was not handled ({_ending[0].actor_label()}; "
                             "its report is above). Set unhandled_fault_hook to handle such failures.")
