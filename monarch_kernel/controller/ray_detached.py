"""A persistent Ray mesh's placement group, as its record keeps it and a later kernel holds it.

The first kernel made the group and its slots detached and named (`ray_cluster.reserve`); the mesh's
record keeps, for each host, the cluster's address, the group's name, the node's id and its slots'
names (`ray_names`). A kernel that attaches the mesh reaches the agents on their nodes' ports, as on
Slurm, and holds a `DetachedRayGroup` as the mesh's allocation: `down` removes the group and kills
the slots by those names; a restart keeps the agents it has (a node Ray lost gets no new agent from
here: that needs a new reservation, `down` then `up`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.controller.hostspec import HostSpec
from monarch_kernel.controller.ray_client import NAMESPACE, connect
from monarch_kernel.controller.ray_cluster import RayReservation, release
from monarch_kernel.core.errors import MeshStartError


def ray_names(allocation: Any) -> list[dict[str, Any]]:
    """What a persistent mesh's record keeps of its Ray reservation, per host ([] for any other allocation)."""
    if not isinstance(allocation, RayReservation):
        return []
    group, slots = allocation.names()
    return [{"ray": {"address": allocation.request.address, "group": group, "node_id": node.node_id,
                     "slots": names}} for node, names in zip(allocation.nodes, slots)]


@dataclass
class DetachedRayGroup:
    """A persistent Ray mesh's group, found by the names its record keeps (an `Allocation`)."""

    address: str | None
    group: str
    node_ids: list[str]
    slots: list[str]
    hosts: tuple[HostSpec, ...] = field(default=())
    _released: bool = False

    @classmethod
    def from_agents(cls, agents: list[dict[str, Any]], hosts: tuple[HostSpec, ...]) -> DetachedRayGroup:
        """From a record's agents (each with its "ray" entry)."""
        first = agents[0]["ray"]
        return cls(first["address"], first["group"], [a["ray"]["node_id"] for a in agents],
                   [slot for a in agents for slot in a["ray"]["slots"]], hosts)

    def status_line(self, max_age_s: float = 0.0) -> str:
        """One line: the group, kept for the next kernel."""
        return f"Ray placement group {self.group} (detached: it outlives kernels), {len(self.node_ids)} node(s)"

    def renew(self) -> tuple[HostSpec, ...]:
        """The same hosts while Ray counts every node alive; else MeshStartError saying to start anew."""
        ray = connect(self.address)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        gone = [host.name for host, node in zip(self.hosts, self.node_ids) if node not in alive]
        if gone:
            raise MeshStartError(f"Ray lost node(s) {', '.join(gone)} of this mesh, which was taken back by attach: "
                                 "a new agent needs a new reservation: %mesh down, then %mesh up ray again")
        return self.hosts

    def abandon(self) -> None:
        """Nothing waits on Ray at a restart here."""

    def release(self) -> None:
        """Kill the slots and remove the group (a cluster that cannot be reached is said, not raised: the slots
        remove the group themselves when their agents end without a kernel)."""
        if self._released:
            return
        self._released = True
        try:
            ray = connect(self.address)
        except MeshStartError as exc:
            print(f"monarch_kernel: the mesh's Ray group {self.group} was not removed now ({exc})", file=sys.stderr)
            return
        from ray.util import get_placement_group

        found = []
        for name in self.slots:
            try:
                found.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:  # already gone (with its node, or the group)
                pass
        try:
            group = get_placement_group(self.group)
        except ValueError:
            group = None
        release(group, found)
