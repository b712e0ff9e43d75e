"""Who an actor is: its name, class, place in the mesh it was spawned on, and who spawned it.

Carried with each spawn (`wire/ops.SpawnActors.creator`) so that an endpoint's `context()`
can tell its actor's lineage, as Monarch's `context().actor_instance` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.core.shape import Point, Shape

ROOT_NAME = "root"  # the client (the notebook, or a Monarch program's main process)


@dataclass(frozen=True)
class ActorIdentity:
    """One actor instance (or the root client): enough to name it and to reach its processes."""

    name: str  # the actor mesh's name (the root client's: "root")
    class_name: str | None  # module-qualified class name (None for the root client)
    rank: Point  # where it was spawned, in the proc mesh it was spawned on
    mesh_name: str  # the mesh of its processes ("" for the root client)
    shape: Shape | None  # the proc mesh it was spawned on (None for the root client)
    creator: ActorIdentity | None  # who spawned it (None for the root client)

    def qualified_name(self) -> str:
        """Monarch's form, from the root down: `<root>.<module.Class name{'gpus': 0/2}>`."""
        names = []
        ins: ActorIdentity | None = self
        while ins is not None:
            prefix = "" if ins.class_name is None else f"{ins.class_name} "
            names.append(f"<{prefix}{ins.name}{ins.rank if len(ins.rank) else ''}>")
            ins = ins.creator
        return ".".join(reversed(names))


@dataclass(frozen=True)
class ActorOrigin:
    """What names the actors of one spawn as Monarch does, without them: who spawned it, the module-qualified
    class, and the proc mesh shape it was spawned on (kept by handles, for reports of dead ranks)."""

    creator: str  # the spawner's qualified name ("<root>" for the client)
    class_name: str  # module-qualified
    shape: Shape

    def actor_name(self, name: str, rank: int) -> str:
        """The qualified name of actor mesh `name`'s actor on global `rank`: `<root>.<mod.Class name{'gpus': 1/2}>`."""
        point = self.shape.numbered_point(rank) if rank in self.shape.ranks else None
        where = str(point) if point is not None and len(point) else ""
        return f"{self.creator}.<{self.class_name} {name}{where}>"


def root_identity() -> ActorIdentity:
    """The root client's identity."""
    return ActorIdentity(ROOT_NAME, None, Point((), 0), "", None, None)
