"""Every error monarch_kernel raises, in one place.

Messages say what failed, for which mesh/rank/host, and how to fix it. Errors that
happened on a rank carry the remote traceback as text and say they are remote.
"""

from __future__ import annotations

from monarch_kernel.core.failures import FailureKind, RankFailure, format_failures


class MeshError(Exception):
    """Base class of all monarch_kernel errors."""


class MonarchWarning(UserWarning):
    """What monarch_kernel warns about (the tests turn these into errors unless a test expects one)."""


class MeshUsageError(MeshError, ValueError):
    """The caller asked for something that cannot be done (bad slice, bad option...)."""


class ActorDeadlockError(MeshUsageError):
    """Actors on one rank wait on each other in a cycle (or an actor on itself): none could ever go on."""


class MeshBusyError(MeshUsageError):
    """A rank has more sent to it, unread, than a lane holds (it is busy in a long cell): nothing was sent."""


class MeshNotRunningError(MeshError, RuntimeError):
    """The mesh was shut down or never came up; start one with `%mesh up` or local_mesh()."""


class MeshStartError(MeshError):
    """A mesh (or one of its hosts) failed to start."""


class CellSyntaxError(MeshError):
    """A cell does not compile; nothing was sent to the ranks."""

    def __init__(self, error: SyntaxError):
        super().__init__(f"{error.msg} ({error.filename}, line {error.lineno}); nothing was sent to the ranks")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        """IPython hook: show it like a local SyntaxError, without our frames."""
        import traceback

        return "".join(traceback.format_exception_only(type(self.error), self.error)).splitlines()


class NoTerminalError(MeshError, EOFError):
    """input() on a rank got no line: nothing could ask the notebook (or it could not answer)."""


class ConnectionClosed(MeshError):
    """A link between two of our processes is closed (the peer exited or the mesh stopped)."""


class SerializationError(MeshError, RuntimeError):
    """A value could not be pickled or unpickled to cross to/from the ranks (a RuntimeError, as Monarch's are)."""


class _FailureReport:
    """Shared behaviour of errors that carry per-rank failures."""

    summary: str
    failures: list[RankFailure]

    def _init_report(self, summary: str, failures: list[RankFailure], partial: object) -> None:
        self.summary = summary
        self.failures = failures
        self.partial = partial

    @property
    def ranks(self) -> list[int]:
        """Ranks that failed, sorted."""
        return sorted(f.rank for f in self.failures)

    def __str__(self) -> str:
        return self.summary + "\n" + format_failures(self.failures, color=False)

    def _render_traceback_(self) -> list[str]:
        """IPython hook: show the remote tracebacks, not our local frames."""
        text = format_failures(self.failures, color=True)
        return [f"\x1b[1;31m{self.summary}\x1b[0m", *text.splitlines()]


class RemoteError(_FailureReport, MeshError):
    """One or more ranks failed while running a cell or a call.

    `failures` holds one RankFailure per failed rank; `partial` holds the values of
    the ranks that finished (a ValueMesh or None).
    """

    def __init__(self, summary: str, failures: list[RankFailure], partial: object = None):
        super().__init__(summary)
        self._init_report(summary, failures, partial)


class RankDiedError(RemoteError):
    """A rank process exited or was killed while work was pending on it."""


class MeshInterrupted(_FailureReport, KeyboardInterrupt):
    """The run was interrupted (a KeyboardInterrupt); each rank's traceback is attached."""

    def __init__(self, summary: str, failures: list[RankFailure], partial: object = None):
        super().__init__(summary)
        self._init_report(summary, failures, partial)


class MeshTimeoutError(RemoteError, TimeoutError):
    """A wait on the mesh ran past its timeout; the ranks were interrupted."""

    def __init__(self, summary: str, failures: list[RankFailure] | None = None, partial: object = None):
        RemoteError.__init__(self, summary, failures or [], partial)


class ActorError(RemoteError):
    """An endpoint raised on some ranks; names the actor, endpoint and ranks."""


class SupervisionError(RemoteError, RuntimeError):
    """An actor call that its actors could not answer: their process died or was lost, or the actor
    mesh was stopped. As in Monarch it is no ActorError, which is an endpoint's own exception."""


ActorDiedError = SupervisionError  # (its name before 0.13: a dead rank is one case of it)


def raise_for(failures: list[RankFailure], summary: str, partial: object,
              error: type[RemoteError] = RemoteError, died: type[RemoteError] = RankDiedError) -> None:
    """Raise the error that fits these failures: interrupted, a rank died, or an exception."""
    if all(f.kind == FailureKind.INTERRUPTED for f in failures):
        raise MeshInterrupted(summary, failures, partial)
    if any(f.kind == FailureKind.DIED for f in failures):
        raise died(summary, failures, partial)
    raise error(summary, failures, partial)
