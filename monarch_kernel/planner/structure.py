"""What a model's structure allows: its repeated blocks, and a tensor-parallel plan found from it.

Tensor parallelism splits an attention's query/key/value projections and an MLP's first
projection by output features (colwise), and the projection after each by input features
(rowwise), so each pair needs one all-reduce. The pairs are found by the names models use for
them (`q_proj`, `c_attn`, `w1`, `up`, `fc1`, ...): a module with such a pair gets it split,
and the number of heads it keeps (`n_head`, `num_heads`, ...) is divided by the degree. Layers
no pair covers (embeddings, norms, convolutions, the output head, custom modules with
parameters) stay replicated and are named; a model without any pair cannot use tensor
parallelism, and the reason says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

COLWISE = {"q", "k", "v", "qkv", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv",
           "c_attn", "in_proj", "up", "gate", "up_proj", "gate_proj", "fc1", "w1", "w3", "c_fc", "fc_in"}
ROWWISE = {"o", "out", "o_proj", "out_proj", "wo", "proj", "c_proj", "down", "down_proj", "fc2", "w2", "fc_out",
           "dense"}
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")
CONFIG_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")
ATTENTION = {"q", "k", "v", "qkv", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "c_attn",
             "in_proj"}
_HEAD_KIND = {"n_head": "attention heads", "n_heads": "attention heads", "num_heads": "attention heads",
              "num_attention_heads": "attention heads", "n_kv_heads": "key/value heads",
              "num_key_value_heads": "key/value heads"}


@dataclass
class TPPlan:
    """Which linear layers tensor parallelism splits, and what it keeps replicated."""

    colwise: list[str] = field(default_factory=list)  # module paths
    rowwise: list[str] = field(default_factory=list)
    heads: list[tuple[str, str]] = field(default_factory=list)  # (module path, attribute) divided by the degree
    replicated: list[str] = field(default_factory=list)  # "name (Type)" of layers with parameters it does not split
    reason: str = ""  # why tensor parallelism cannot be used here ("" if it can)

    @property
    def applicable(self) -> bool:
        """Whether there is anything to split."""
        return not self.reason


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: the children of its largest ModuleList or ModuleDict (by parameters;
    torchtitan keeps its blocks in a ModuleDict keyed "0", "1", ...), with their paths; its top-level
    children if it has neither."""
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    if best is None:
        return [(name, child) for name, child in model.named_children() if any(True for _ in child.parameters())]
    _, prefix, found = best
    return [(f"{prefix}.{key}" if prefix else key, child) for key, child in found.named_children()]


def tp_plan(model: nn.Module, degree: int) -> TPPlan:
    """The tensor-parallel plan of a model at a degree (see the module docstring)."""
    plan = TPPlan()
    covered: set[str] = set()
    for parent_name, parent in model.named_modules():
        linears = [(name, child) for name, child in parent.named_children() if isinstance(child, nn.Linear)]
        cols = [(n, c) for n, c in linears if n in COLWISE]
        rows = [(n, c) for n, c in linears if n in ROWWISE]
        if not cols or not rows:
            continue
        path = (parent_name + ".") if parent_name else ""
        if any(c.out_features % degree for _, c in cols) or any(r.in_features % degree for _, r in rows):
            plan.replicated += [f"{path}{n} (Linear: features not divisible by {degree})" for n, _ in cols + rows]
            covered.update(path + n for n, _ in cols + rows)
            continue
        heads = [(parent_name, attr) for attr in HEAD_COUNTS if isinstance(getattr(parent, attr, None), int)]
        uneven = [f"{degree} does not divide the {getattr(parent, attr)} {_HEAD_KIND.get(attr, 'heads')}"
                  for _, attr in heads if getattr(parent, attr) % degree]
        if any(n in ATTENTION for n, _ in cols):  # (Hugging Face keeps the counts in the module's config)
            config = getattr(parent, "config", None)
            uneven += [f"{degree} does not divide the {count} {_HEAD_KIND[attr]}" for attr in CONFIG_HEAD_COUNTS
                       if isinstance(count := getattr(config, attr, None), int) and count % degree]
        if uneven:
            plan.replicated += [f"{path}{n} (Linear: {'; '.join(dict.fromkeys(uneven))})" for n, _ in cols + rows]
            covered.update(path + n for n, _ in cols + rows)
            continue
        plan.colwise += [path + n for n, _ in cols]
        plan.rowwise += [path + n for n, _ in rows]
        plan.heads += heads
        covered.update(path + n for n, _ in cols + rows)
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and name not in covered and not any(name.startswith(c + ".") for c in covered):
            plan.replicated.append(f"{name} ({type(module).__name__})")
    if not plan.colwise:
        kinds = sorted({entry.split("(")[-1].rstrip(")") for entry in plan.replicated})
        plan.reason = ("no attention or MLP projection pairs (a colwise layer followed by a rowwise one) were found; "
                       f"layers it cannot split: {', '.join(kinds) or 'none with parameters'}")
    return plan
