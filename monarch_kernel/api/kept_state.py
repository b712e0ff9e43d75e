"""What the ranks keep across kernels, as a `Mesh` shows it: the actor meshes spawned on them (by
name, for a kernel that attached to a mesh it did not start), and what ran to its end while no kernel
held the mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch_kernel.actors.client import ActorMesh
from monarch_kernel.controller.persistence import DetachedResult, PersistentRuntime
from monarch_kernel.core.errors import MeshUsageError
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.wire.ops import ActorMeshEntry, ListActorMeshes, RankOperation


class KeptState:
    """`Mesh`'s view of what its ranks hold beyond one kernel (it provides `_runtime` and `_ask`)."""

    _runtime: Any
    _ask: Callable[[RankOperation, str], ValueMesh]  # runs an operation on the ranks of this mesh (or slice)

    def actor_meshes(self) -> list[str]:
        """The names of the actor meshes spawned on these ranks (by this kernel or an earlier one)."""
        return sorted(self._found_actor_meshes())

    def actor_mesh(self, name: str) -> ActorMesh:
        """A handle on actor mesh `name`, spawned on these ranks (by this kernel or one before it)."""
        found = self._found_actor_meshes()
        if name not in found:
            raise MeshUsageError(f"no actor mesh named {name!r} on mesh {self._runtime.name!r} "
                                 f"(actor meshes: {', '.join(sorted(found)) or 'none'})")
        entry = found[name]
        return ActorMesh(self._runtime.name, name, entry.class_name, frozenset(entry.endpoints), entry.shape, entry.key,
                         entry.parameters)

    def _found_actor_meshes(self) -> dict[str, ActorMeshEntry]:
        found: dict[str, ActorMeshEntry] = {}
        for per_rank in self._ask(ListActorMeshes(), "actor_meshes()").values():
            for name, entry in (per_rank or {}).items():
                found.setdefault(name, entry)
        return found

    @property
    def detached_results(self) -> list[DetachedResult]:
        """What ran to its end while no kernel held this mesh (after an attach): each request's label, each
        rank's output, values and errors. Empty for a mesh this kernel started."""
        runtime = self._runtime
        return runtime.detached_results() if isinstance(runtime, PersistentRuntime) else []
