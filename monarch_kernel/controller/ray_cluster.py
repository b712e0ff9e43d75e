"""Ray clusters as meshes: a placement group with one bundle per rank, a slot actor in each bundle, one
host agent per node.

The reservation is ordinary Ray work, so Ray's scheduler, quotas and autoscaler see it: a placement
group of `hosts * gpus` bundles (`{"GPU": gpus_per_rank, ...resources}` each; PACK or SPREAD, or any
of Ray's strategies), then a `RankSlot` actor (`agent/ray_slot.py`) placed in each bundle, which
learns its node and the GPUs Ray gave it. The bundles must land as `hosts` nodes of `gpus` each (a
mesh is a grid); if Ray placed them otherwise, the group is removed and the error says how they fell.
The first slot of each node starts the node's agent when the mesh opens that host (`ray_agent.py`).

Both the group and the slots belong to the kernel's Ray job: if the kernel dies, Ray removes them
(a Ray client's job ends after Ray's reconnect grace period), the slots' end closes the agents'
stdin and the agents stop their ranks. `release()` does the same at once for `down`.

A persistent mesh's group and slots are detached instead, and named (the group `monarch-NAME-PID-N`,
its slots `...-slot-I`, in our namespace): they outlive the kernel, a later kernel finds them by
those names (`DetachedRayGroup`), and the slots remove the group when their agents end on their own
(`agent/ray_slot.py`), so that a mesh whose persist time ran out holds nothing in Ray either.

`ray` is imported here and in `ray_client.py` only (an optional extra: `pip install monarch-kernel[ray]`);
the kernel's connection to the cluster is `ray_client.py`'s.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.agent.ray_slot import RankSlot
from monarch_kernel.controller.hostspec import HostKind, HostSpec
from monarch_kernel.controller.ray_agent import RayNode
from monarch_kernel.controller.ray_client import NAMESPACE, connect, import_ray
from monarch_kernel.core.errors import MeshStartError, MeshUsageError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
SLOT_TIMEOUT_S = 120.0  # the slots' start (a Ray worker process each) on a busy cluster
_RESERVATIONS = itertools.count()


@dataclass(frozen=True)
class RayRequest:
    """What to ask Ray for: `hosts` nodes of `gpus` ranks, each rank one bundle."""

    address: str | None = None  # "auto", "ray://HEAD:10001", "HEAD:6379"; None: the Ray this process runs, else auto
    hosts: int = 1
    gpus: int = 1  # ranks per node
    gpus_per_rank: float = 1.0
    request_gpus: bool = True  # False: CPU nodes (bundles ask for `resources`, or one CPU)
    resources: dict[str, float] = field(default_factory=dict)  # per rank, besides GPUs ("CPU", "memory", custom)
    strategy: str = "PACK"
    name: str = "mesh"
    wait_timeout: float | None = None
    python: str | None = None  # the agents' interpreter; None: the one the nodes' Ray workers run
    detached: bool = False  # a persistent mesh: the group and slots outlive the kernel's Ray job

    def bundle(self) -> dict[str, float]:
        """One rank's bundle."""
        wanted = {"GPU": self.gpus_per_rank} if self.request_gpus else {}
        wanted.update(self.resources)
        return wanted or {"CPU": 1.0}

    def check(self) -> None:
        """MeshUsageError for a request Ray cannot be asked."""
        if not isinstance(self.hosts, int) or self.hosts < 1 or not isinstance(self.gpus, int) or self.gpus < 1:
            raise MeshUsageError(f"hosts={self.hosts!r}, gpus={self.gpus!r}: give positive numbers of nodes and "
                                 "ranks per node")
        if self.strategy not in STRATEGIES:
            raise MeshUsageError(f"strategy {self.strategy!r}: use one of Ray's {', '.join(STRATEGIES)}")
        bad = [k for k, v in self.resources.items() if not isinstance(v, (int, float)) or v < 0]
        if bad:
            raise MeshUsageError(f"resources {bad}: give each as a non-negative number per rank")


@dataclass
class RayReservation:
    """A mesh's placement group and slots (an `Allocation`): what `down` releases and a restart reuses."""

    request: RayRequest
    group: Any  # ray.util.placement_group.PlacementGroup
    nodes: list[RayNode]
    group_name: str = ""
    slots_in_order: list[Any] = field(default_factory=list)  # in bundle order (slot I is named GROUP-slot-I when detached)
    _released: bool = False
    abandoned: threading.Event = field(default_factory=threading.Event)

    def host_specs(self) -> tuple[HostSpec, ...]:
        """One host per node, its agent started by the node's first slot."""
        return tuple(HostSpec(_host_name(node, self.nodes), HostKind.RAY, target=node.address,
                              python=self.request.python or node.python,
                              options={"node": node, "address": node.address,
                                       "env": {"CUDA_VISIBLE_DEVICES": ",".join(node.gpu_ids)}
                                       if self.request.request_gpus and node.gpu_ids else {}})
                     for node in self.nodes)

    def status_line(self, max_age_s: float = 0.0) -> str:
        """One line: the placement group and its nodes."""
        return (f"Ray placement group {self.group.id.hex()[:12]} ({self.request.strategy}"
                f"{', detached' if self.request.detached else ''}), "
                f"{len(self.nodes)} node(s) x {self.request.gpus} bundle(s) of {self.request.bundle()}")

    def names(self) -> tuple[str, list[list[str]]]:
        """The group's name and each node's slot names (a persistent mesh's record keeps them)."""
        index = {id(slot): i for i, slot in enumerate(self.slots_in_order)}
        return self.group_name, [[slot_name(self.group_name, index[id(slot)]) for slot in node.slots]
                                 for node in self.nodes]

    def renew(self) -> tuple[HostSpec, ...]:
        """Hosts for a restart: the same slots while Ray holds them all, else a new reservation."""
        ray = import_ray()
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if all(node.node_id in alive for node in self.nodes) and self._slots_answer():
            return self.host_specs()
        self.release()
        fresh = reserve(self.request, print, stop=self.abandoned.is_set)
        self.group, self.nodes, self._released = fresh.group, fresh.nodes, False
        self.group_name, self.slots_in_order = fresh.group_name, fresh.slots_in_order
        return self.host_specs()

    def _slots_answer(self) -> bool:
        ray = import_ray()
        try:
            ray.get([slot.agent_exit.remote() for node in self.nodes for slot in node.slots], timeout=10)
        except Exception:  # noqa: BLE001 - a slot died with its node or was killed
            return False
        return True

    def abandon(self) -> None:
        """A restart waiting for a new reservation was stopped: stop waiting (the new group is removed)."""
        self.abandoned.set()

    def release(self) -> None:
        """Remove the slots and the placement group (their agents end with them)."""
        if self._released:
            return
        self._released = True
        release(self.group, [slot for node in self.nodes for slot in node.slots])


def release(group: Any, slots: list[Any]) -> None:
    """Kill the slots and remove the group, ignoring what Ray already removed."""
    ray = import_ray()
    from ray.util.placement_group import remove_placement_group

    for slot in slots:
        try:
            ray.kill(slot)
        except Exception:  # noqa: BLE001 - already dead (its node went)
            pass
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - already removed
        pass


def _host_name(node: RayNode, nodes: list[RayNode]) -> str:
    """The node's host name, or its address where two nodes share a name."""
    same = sum(1 for other in nodes if other.hostname == node.hostname)
    return node.hostname if same == 1 else f"{node.hostname}-{node.address}"


def slot_name(group_name: str, index: int) -> str:
    """The name of a detached group's slot for bundle `index`."""
    return f"{group_name}-slot-{index}"


def reserve(request: RayRequest, show: Callable[[str], None], *,
            stop: Callable[[], bool] = lambda: False) -> RayReservation:
    """Ask Ray for the group, wait for it visibly, place the slots; MeshStartError (nothing left) if it fails.

    Ctrl-C (the stop button), `request.wait_timeout` or `stop()` while waiting removes the request."""
    request.check()
    ray = connect(request.address)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    count = request.hosts * request.gpus
    group_name = f"monarch-{request.name}-{os.getpid()}-{next(_RESERVATIONS)}"  # (a restart's names are new)
    detached: dict[str, Any] = {"lifetime": "detached"} if request.detached else {}
    group = placement_group([request.bundle()] * count, strategy=request.strategy, name=group_name, **detached)
    slots: list[Any] = []
    try:
        _wait_placed(ray, group, request, count, show, stop)
        slot_class = ray.remote(RankSlot)
        for index in range(count):
            named = {"name": slot_name(group_name, index), "namespace": NAMESPACE, **detached} if request.detached else {}
            slots.append(slot_class.options(
                num_cpus=0, num_gpus=request.gpus_per_rank if request.request_gpus else 0, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                **named,
            ).remote(request.detached))
        try:
            places = ray.get([slot.where.remote() for slot in slots], timeout=SLOT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise MeshStartError(f"the mesh's {count} Ray slots did not start within {SLOT_TIMEOUT_S:.0f} s") from None
        nodes = _group_by_node(slots, places, request)
    except BaseException:
        release(group, slots)
        raise
    return RayReservation(request, group, nodes, group_name, slots)


def _wait_placed(ray: Any, group: Any, request: RayRequest, count: int, show: Callable[[str], None],
                 stop: Callable[[], bool]) -> None:
    """Until Ray has placed every bundle; one line rewritten in place while it waits."""
    started = time.monotonic()
    ready = group.ready()
    shown = False
    while True:
        done, _ = ray.wait([ready], timeout=0.2)
        if done:
            if shown:
                show("\n")
            return
        waited = time.monotonic() - started
        if request.wait_timeout is not None and waited > request.wait_timeout:
            raise MeshStartError(f"Ray did not place the {count} bundles of {request.bundle()} "
                                 f"({request.strategy}) within {request.wait_timeout:.0f} s; the cluster has "
                                 f"{_free(ray)}. The request was removed")
        if stop():
            raise MeshStartError("the wait for Ray's placement was abandoned; the request was removed")
        if waited > 1.0:
            show(f"\rwaiting for Ray to place {count} bundles of {request.bundle()} ({request.strategy}): "
                 f"{waited:.0f} s; free now: {_free(ray)}   ")
            shown = True


def _free(ray: Any) -> str:
    try:
        free = ray.available_resources()
    except Exception:  # noqa: BLE001 - only for the message
        return "(Ray did not say what is free)"
    return ", ".join(f"{free.get(k, 0):g} {k}" for k in ("GPU", "CPU")) + " free"


def _group_by_node(slots: list[Any], places: list[Any], request: RayRequest) -> list[RayNode]:
    """The slots by node, in bundle order; MeshStartError unless they make `hosts` nodes of `gpus` each."""
    by_node: dict[str, RayNode] = {}
    for slot, place in zip(slots, places):
        node = by_node.get(place.node_id)
        if node is None:
            node = by_node[place.node_id] = RayNode(place.node_id, place.address, place.hostname, [], (), place.python)
        node.slots.append(slot)
        node.gpu_ids = (*node.gpu_ids, *place.gpu_ids)
    nodes = list(by_node.values())
    if len(nodes) != request.hosts or any(len(n.slots) != request.gpus for n in nodes):
        fell = " + ".join(f"{len(n.slots)} on {n.hostname}" for n in nodes)
        hint = ("--spread (SPREAD) to spread them" if request.strategy in ("PACK", "STRICT_PACK")
                else "--pack (PACK) to pack them")
        raise MeshStartError(f"Ray placed the {len(slots)} ranks as {fell}, not as {request.hosts} node(s) of "
                             f"{request.gpus}: a mesh is a grid of hosts x ranks. Try {hint}, or ask for ranks "
                             "per node that match the nodes' GPUs; the group was removed")
    return nodes
