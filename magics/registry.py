"""The meshes a notebook session holds, by name; the newest is the default."""

from __future__ import annotations

from monarch_kernel.api.mesh import Mesh
from monarch_kernel.core.errors import MeshNotRunningError, MeshUsageError


class MeshRegistry:
    """Named meshes started from magics, with a current default."""

    def __init__(self) -> None:
        self._meshes: dict[str, Mesh] = {}
        self._current: str | None = None
        self._adopted: set[str] = set()  # started by a program (spawn_procs), not by %mesh up

    def adopt(self, mesh: Mesh) -> None:
        """A mesh a program started (Monarch's spawn_procs): listed and usable like the others, the
        default, and forgotten once it is shut down."""
        self._prune()
        old = self._meshes.get(mesh.name)
        if old is not None and not old.closed:
            return  # a name in use keeps its mesh (the program's mesh is still reachable through its handle)
        self._meshes[mesh.name] = mesh
        self._adopted.add(mesh.name)
        self._current = mesh.name

    def _prune(self) -> None:
        for name in [n for n in self._adopted if n in self._meshes and self._meshes[n].closed]:
            self._adopted.discard(name)
            self.remove(name)

    def add(self, mesh: Mesh) -> None:
        """Register a new mesh and make it the default."""
        if mesh.name in self._meshes:
            raise MeshUsageError(f"a mesh named {mesh.name!r} is already up; pick another --name or %mesh down {mesh.name}")
        self._meshes[mesh.name] = mesh
        self._current = mesh.name

    def get(self, name: str | None = None) -> Mesh:
        """The named mesh, or the default one."""
        self._prune()
        if name is None:
            if self._current is None:
                raise MeshNotRunningError("no mesh is up: start one with %mesh up local --gpus 4")
            name = self._current
        mesh = self._meshes.get(name)
        if mesh is None:
            known = ", ".join(self._meshes) or "none"
            raise MeshUsageError(f"no mesh named {name!r} (meshes up: {known})")
        return mesh

    def use(self, name: str) -> Mesh:
        """Make the named mesh the default."""
        mesh = self.get(name)
        self._current = name
        return mesh

    def remove(self, name: str) -> Mesh:
        """Forget a mesh (after shutting it down); the newest remaining becomes default."""
        mesh = self._meshes.pop(name)
        if self._current == name:
            self._current = next(reversed(self._meshes), None)
        return mesh

    def names(self) -> list[str]:
        """Names in start order."""
        self._prune()
        return list(self._meshes)

    @property
    def current(self) -> str | None:
        """The default mesh's name."""
        return self._current

    def shutdown_all(self) -> None:
        """Shut down every mesh (kernel exit, extension unload); persistent ones wait for the next kernel."""
        for name in list(self._meshes):
            mesh = self._meshes.pop(name)
            try:
                mesh.leave()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._current = None
