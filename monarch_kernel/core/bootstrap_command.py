"""How a new process of `spawn_procs` starts, as Monarch's `BootstrapCommand`: the interpreter and the
environment variables, the same for every process or chosen per process (a callable of its Point).

>>> cmd = default_bootstrap_cmd().with_env({"NCCL_DEBUG": "INFO"})
>>> this_host().spawn_procs(per_host={"gpus": 2}, bootstrap_command=cmd)
>>> this_host().spawn_procs(per_host={"gpus": 2},
...     bootstrap_command=lambda point: cmd.with_env({"CUDA_VISIBLE_DEVICES": str(point["gpus"])}))

Our ranks are forked from their host's agent (warm, with torch imported), not started one by one: a
command's `program` is the interpreter the host's agent runs (as `HostMesh.with_python_executable`), one
per mesh, and its `env` is set in each process before any of the user's code runs. Other arguments than
the default ones cannot apply to a forked process and are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class BootstrapCommand:
    """A process's start: `program` (an interpreter, or a script that execs one) and `env` (Monarch's arg0 and
    args are accepted as None and empty only)."""

    program: str
    arg0: str | None = None
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", dict(self.env))

    def with_env(self, env: Mapping[str, str]) -> BootstrapCommand:
        """The same command with these variables added (a new command; this one is unchanged)."""
        return replace(self, env={**self.env, **env})


def default_bootstrap_cmd() -> BootstrapCommand:
    """The command new processes start with when none is given: this interpreter, no extra variables."""
    return BootstrapCommand(sys.executable)
