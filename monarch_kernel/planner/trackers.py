"""torch's memory trackers as the planner uses them: on fake tensors for an estimate, on real ones
for a CPU trial (a GPU trial reads `max_memory_allocated`).

`FSDPMemTracker` follows FSDP's own hooks (sharded and unsharded parameters, all-gather and
reduce-scatter buffers); `MemTracker` follows everything else. Both take a second forward of the
model they track as the next iteration and refuse it, which a pipeline stage does on purpose
(once per micro-batch; torch's module tracker forgets its parents at the end of every backward,
so no wrapper around the step helps). The trackers here forget that module's own statistics when
it enters again instead: the totals and the peak, which the planner reads, are kept whole; only
the per-module figures of the stage's root restart with each micro-batch.

Per-module peaks cost torch's trackers a walk over every tracked module at every operator
(most of an estimate's time for a model of 24 blocks); without `per_module` only the totals'
peak is kept up to date, which is all a plan's ranking reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from monarch_kernel.planner.hardware import CATEGORIES

# torch's tracker categories (by their display names) -> ours
_CATEGORY_OF = {
    "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "params", "Buffer": "params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer", "Other": "temporary",
    "Activation": "activations",
    "Temp": "temporary", "Inputs": "temporary",
    "All Gather": "buffers", "Reduce Scatter": "buffers",
}


def memory_tracker(module: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool, per_module: bool = False) -> Any:
    """The tracker for a model (FSDP's for a fully sharded one), following its optimizer too;
    per_module: also each module's peak (slower)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    def forget_repeated_root(tracker: Any, mod: nn.Module) -> None:
        name = tracker._mod_tracker.get_known_fqn(mod)
        entered_again = mod in tracker.memory_tracking and not tracker._mod_tracker.is_bw
        if entered_again and set(tracker._mod_tracker.parents) - {name} == {"Global"}:
            del tracker.memory_tracking[mod]

    def update_total_peak(tracker: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot["Total"]:
                tracker._peak_mem[device] = snapshot["Total"]
                tracker._peak_mem_snap[device] = dict(snapshot)

    class StageMemTracker(MemTracker):
        def _pre_fw_hook(self, mod: nn.Module, inputs: Any) -> None:
            forget_repeated_root(self, mod)
            super()._pre_fw_hook(mod, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            if per_module:
                super()._update_peak_stats(peak_state)
            else:
                update_total_peak(self)

    class StageFSDPMemTracker(FSDPMemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            if per_module:
                super()._update_peak_stats(peak_state)
            else:
                update_total_peak(self)

        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def pre_forward(*args: Any, **kwargs: Any) -> Any:
                forget_repeated_root(self, fsdp_mod)
                return inner(*args, **kwargs)

            return pre_forward

    if fsdp:
        return StageFSDPMemTracker(module, optimizer)
    tracker = StageMemTracker()
    tracker.track_external(module, optimizer)
    return tracker


def track_optimizer_state(tracker: Any, optimizer: torch.optim.Optimizer) -> None:
    """File the optimizer's present state with the tracker as optimizer state (as its step's hook does)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _MemRefType

    kind = _FSDPRefType.OPT if isinstance(tracker, FSDPMemTracker) else _MemRefType.OPT
    tracker._track_optimizer_states(kind, optimizer)


def peak_by_category(tracker: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """The tracker's peak, in our categories (they add up to its total).

    torch's trackers file everything made during the optimizer's step under its state, the step's
    temporaries too (two copies of the largest parameter for AdamW: most of a recommender's "optimizer"
    was its largest table's temporaries). Given the optimizer, what exceeds its state's bytes moves to
    "temporary"."""
    peak: dict[Any, int] = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    memory = dict.fromkeys(CATEGORIES, 0)
    for kind, size in peak.items():
        name = getattr(kind, "value", str(kind))
        if name != "Total":
            memory[_CATEGORY_OF.get(name, "temporary")] += int(size)
    if optimizer is not None:
        held = optimizer_state_bytes(optimizer)
        if memory["optimizer"] > held:
            memory["temporary"] += memory["optimizer"] - held
            memory["optimizer"] = held
    return memory


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (a DTensor's local shard; each storage once)."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if hasattr(value, "to_local") else value
            storage = local.untyped_storage()
            key = storage._cdata  # (the storage itself: fake tensors have no data pointer)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
