"""The planner on a live mesh: the ranks' measured figures (once per mesh), trials, and apply."""

from __future__ import annotations

import dataclasses
from typing import Any

from monarch_kernel.api.session import Session
from monarch_kernel.core.errors import MeshUsageError, MonarchWarning
from monarch_kernel.planner.hardware import Figures, size_text
from monarch_kernel.planner.layout import Layout
from monarch_kernel.planner.measure import RankFigures, TrialMeasurement
from monarch_kernel.wire.ops import ApplyLayout, CollectGarbage, MeasureRank, TrialLayout
from monarch_kernel.wire.serialization import seal


def mesh_figures(mesh: Any) -> Figures:
    """The slowest rank's throughput, the smallest memory, and the links, measured once per mesh."""
    found = Session.current().of_mesh(mesh._runtime, _MeasuredFigures, _MeasuredFigures).figures
    if found is None:
        values: list[RankFigures] = list(mesh._ask(MeasureRank(), "measure the ranks", timeout=300).values())
        found = Figures(memory=int(min(v.memory for v in values)), flops=min(v.flops_fp32 for v in values),
                        intra_host_bandwidth=min(v.intra_host_bandwidth for v in values),
                        inter_host_bandwidth=min(v.inter_host_bandwidth for v in values),
                        source=f"measured on mesh {mesh.name!r}",
                        flops_bf16=min(v.flops_bf16 for v in values), latency=max(v.latency for v in values),
                        op_overhead=max(v.op_overhead for v in values),
                        dtensor_overhead=max(v.dtensor_overhead for v in values),
                        links=_slowest_links([v.links for v in values]))
        Session.current().of_mesh(mesh._runtime, _MeasuredFigures, _MeasuredFigures).figures = found
    return dataclasses.replace(found)


class _MeasuredFigures:
    """A mesh's figures, measured once (kept by the notebook's session)."""

    figures: Figures | None = None


def _slowest_links(per_rank: list[dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, list[float]]]:
    """Per scope and kind, the highest latency and the lowest bandwidth any rank measured."""
    merged: dict[str, dict[str, list[float]]] = {}
    for links in per_rank:
        for scope, kinds in links.items():
            for kind, (latency, bandwidth, ranks) in kinds.items():
                seen = merged.setdefault(scope, {}).setdefault(kind, [latency, bandwidth, ranks])
                seen[0], seen[1] = max(seen[0], latency), min(seen[1], bandwidth)
    return merged


def _require_mesh(plan: Any) -> Any:
    if plan.mesh is None:
        raise MeshUsageError("this plan was made for a world you do not have (world=...): trial and apply need a "
                             "mesh; make the plan with mesh.plan(...)")
    return plan.mesh


def trial(plan: Any, steps: int) -> None:
    """Run each fitting candidate for real (one after the other) and record what it measured."""
    mesh = _require_mesh(plan)
    sealed = seal((plan.spec, plan.batch()))
    for candidate in plan.candidates:
        if not candidate.fits:
            continue
        measured: list[TrialMeasurement] = list(mesh._ask(TrialLayout(sealed, candidate.layout, steps),
                                                           f"trial {candidate.layout}", timeout=1800).values())
        candidate.measured_step_seconds = max(m.step_seconds for m in measured)
        candidate.measured_peak_bytes = max(m.peak_bytes for m in measured)
    # the trials' models go now, all at once (collecting between trials made the next trial's measured peak
    # come out in one of two values, 16% apart, from run to run)
    mesh._ask(CollectGarbage(), "collect the trials' garbage")


def apply(plan: Any, candidate: Any, seed: int, names: tuple[str, str, str]) -> Any:
    """Build the model in `candidate`'s layout on every rank and bind it there under `names`."""
    import dataclasses
    import warnings

    mesh = _require_mesh(plan)
    if not candidate.applicable:
        raise MeshUsageError(f"layout {candidate.layout} does not apply to this model: {candidate.reason}")
    if not candidate.fits:
        warnings.warn(f"layout {candidate.layout} does not fit ({candidate.reason}); applying it as asked", MonarchWarning,
                      stacklevel=3)
    spec = dataclasses.replace(plan.spec, seed=seed)
    layout = Layout.parse(candidate.layout)
    batch = plan.batch() if layout.pp > 1 else None  # (a pipeline is traced on the batch's shape)
    model_name, optimizer_name, step_name = names

    sealed = seal((spec, batch))
    mesh._ask(ApplyLayout(sealed, layout.text, (model_name, optimizer_name, step_name)), f"plan.apply({layout})", timeout=1800)
    print(f"applied {layout} on {mesh.name!r}: {model_name}, {optimizer_name} and {step_name}(batch) are bound on "
          f"every rank (estimated peak {size_text(candidate.peak_bytes)} per rank)")
    return candidate
