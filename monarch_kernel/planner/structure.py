"""What a model's structure allows: its repeated blocks, and a tensor-parallel plan found from it.

Tensor parallelism splits an attention's query/key/value projections and an MLP's first
projection by output features (colwise), and the projection after each by input features
(rowwise), so each pair needs one all-reduce. The pairs are found by the names models use for
them (`q_proj`, `c_attn`, `w1`, `up`, `fc1`, ...): a module with such a pair gets it split,
and the number of heads it keeps (`n_head`, `num_heads`, ...) is divided by the degree. Layers
no pair covers (embeddings, norms, convolutions, the output head, custom modules with
parameters) stay replicated and are named.

Embedding tables are split too, where they hold a weight of their own: an `nn.Embedding` by rows
(torch's RowwiseParallel: each rank looks up the ids in its rows, one all-reduce joins them), an
`nn.EmbeddingBag` by columns (`tp_styles.EmbeddingBagColwise`: each rank pools its columns, one
all-gather joins them). A table tied to another layer's weight (a language model's head), one
whose rows (or columns) the degree does not divide, or one that renormalises rows (`max_norm`),
takes sparse gradients or scales them by frequency stays replicated, with that reason.

A mixture of experts (Hugging Face's experts modules, weights stacked one slice per expert) is split
by experts: expert parallelism over the tensor-parallel ranks (`tp_styles.ExpertsSharded`), where the
degree divides the experts. A model with no pairs, tables or experts to split cannot use tensor
parallelism, and the reason says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

COLWISE = {"q", "k", "v", "qkv", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv",
           "c_attn", "in_proj", "up", "gate", "up_proj", "gate_proj", "fc1", "w1", "w3", "c_fc", "fc_in",
           "qkv_proj", "wqkv", "Wqkv", "query_key_value"}
FUSED = {"qkv", "c_attn", "in_proj", "qkv_proj", "wqkv", "Wqkv", "query_key_value"}  # query, key, value in one
ROWWISE = {"o", "out", "o_proj", "out_proj", "wo", "proj", "c_proj", "down", "down_proj", "fc2", "w2", "fc_out",
           "dense"}
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")
CONFIG_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")
ATTENTION = {"q", "k", "v", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"} | FUSED
_HEAD_KIND = {"n_head": "attention heads", "n_heads": "attention heads", "num_heads": "attention heads",
              "num_attention_heads": "attention heads", "n_kv_heads": "key/value heads",
              "num_key_value_heads": "key/value heads"}


@dataclass
class TPPlan:
    """Which linear layers tensor parallelism splits, and what it keeps replicated."""

    colwise: list[str] = field(default_factory=list)  # module paths
    rowwise: list[str] = field(default_factory=list)
    heads: list[tuple[str, str]] = field(default_factory=list)  # (module path, attribute) divided by the degree
    embeddings: list[str] = field(default_factory=list)  # tables split: Embedding by rows, EmbeddingBag by columns
    experts: list[str] = field(default_factory=list)  # mixtures of experts split by experts (expert parallelism)
    replicated: list[str] = field(default_factory=list)  # "name (Type)" of layers with parameters it does not split
    reason: str = ""  # why tensor parallelism cannot be used here ("" if it can)

    @property
    def applicable(self) -> bool:
        """Whether there is anything to split."""
        return not self.reason


def is_conv1d(module: nn.Module) -> bool:
    """Whether a module is a linear layer of the Conv1D kind (GPT-2's: weight (in, out), bias (out,))."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, nn.Parameter | torch.Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf)


def features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer (nn.Linear or Conv1D); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if is_conv1d(module) and isinstance(weight, torch.Tensor):
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _sibling_pairs(parent_name: str, parent: nn.Module,
                   ) -> list[tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]], str, nn.Module]]:
    """Pairs split across a module's children, as BERT, RoBERTa and ViT have them: an `output` child whose
    `dense` projection follows a sibling's attention projections (`self.query/key/value`) or a sibling
    `intermediate`'s `dense`. Each: (colwise, rowwise, the module holding the head counts, its path)."""
    children = dict(parent.named_children())
    output = getattr(children.get("output"), "dense", None)
    if not isinstance(output, nn.Linear):
        return []
    path = (parent_name + ".") if parent_name else ""
    rows: list[tuple[str, nn.Module]] = [(f"{path}output.dense", output)]
    found: list[tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]], str, nn.Module]] = []
    for name, sibling in children.items():
        if name == "output":
            continue
        linears = [(n, c) for n, c in sibling.named_children() if features(c) is not None]
        attention = [(f"{path}{name}.{n}", c) for n, c in linears if n in ATTENTION]
        dense = getattr(sibling, "dense", None)
        if name == "intermediate" and isinstance(dense, nn.Linear):
            found.append(([(f"{path}{name}.dense", dense)], rows, f"{path}{name}", sibling))
        elif attention and not any(n in ROWWISE for n, _ in linears):
            found.append((attention, rows, f"{path}{name}", sibling))
    return found


def _add_pair(plan: TPPlan, covered: set[str], cols: list[tuple[str, nn.Module]], rows: list[tuple[str, nn.Module]],
              owner_name: str, owner: nn.Module, degree: int) -> None:
    """Split a pair of colwise and rowwise layers (with `owner`'s head counts divided), or name why not."""
    paths = [p for p, _ in cols + rows]
    covered.update(paths)
    kind = {path: type(module).__name__ for path, module in cols + rows}
    fused = [p for p, _ in cols if p.rsplit(".", 1)[-1] in FUSED]
    if fused:
        plan.replicated += [f"{p} ({kind[p]}: {fused[0].rsplit('.', 1)[-1]} holds query, key and value in one "
                            "projection; splitting its output features in contiguous parts would hand each rank a "
                            "wrong mix of them)" for p in paths]
        return
    if any(_out(c) % degree for _, c in cols) or any(_in(r) % degree for _, r in rows):
        plan.replicated += [f"{p} ({kind[p]}: features not divisible by {degree})" for p in paths]
        return
    heads = [(owner_name, attr) for attr in HEAD_COUNTS if isinstance(getattr(owner, attr, None), int)]
    uneven = [f"{degree} does not divide the {getattr(owner, attr)} {_HEAD_KIND.get(attr, 'heads')}"
              for _, attr in heads if getattr(owner, attr) % degree]
    if any(p.rsplit(".", 1)[-1] in ATTENTION for p, _ in cols):  # (Hugging Face keeps the counts in the config)
        config = getattr(owner, "config", None)
        uneven += [f"{degree} does not divide the {count} {_HEAD_KIND[attr]}" for attr in CONFIG_HEAD_COUNTS
                   if isinstance(count := getattr(config, attr, None), int) and count % degree]
    if uneven:
        plan.replicated += [f"{p} ({kind[p]}: {'; '.join(dict.fromkeys(uneven))})" for p in paths]
        return
    plan.colwise += [p for p, _ in cols]
    plan.rowwise += [p for p, _ in rows]
    plan.heads += heads


def _in(module: nn.Module) -> int:
    return (features(module) or (0, 0))[0]


def _out(module: nn.Module) -> int:
    return (features(module) or (0, 0))[1]


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


def _tied(model: nn.Module) -> dict[int, list[str]]:
    """The parameters the model holds under more than one name (tied weights), by id: their names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {key: found for key, found in names.items() if len(found) > 1}


def _add_table(plan: TPPlan, path: str, table: nn.Embedding | nn.EmbeddingBag, degree: int,
               tied: dict[int, list[str]]) -> None:
    """Split an embedding table (see the module docstring), or name why it stays whole."""
    kind = type(table).__name__
    rows, dim = table.weight.shape
    bag = isinstance(table, nn.EmbeddingBag)
    others = [name for name in tied.get(id(table.weight), []) if name != f"{path}.weight"]
    why = ""
    if others:
        why = f"its weight is tied to {others[0]}; splitting one would untie them"
    elif table.max_norm is not None:
        why = "max_norm renormalises whole rows"
    elif table.sparse:
        why = "sparse gradients"
    elif table.scale_grad_by_freq and not bag:
        why = "scale_grad_by_freq counts ids over the whole table"
    elif bag and dim % degree:
        why = f"{degree} does not divide its {dim} columns"
    elif not bag and rows % degree:
        why = f"{degree} does not divide its {rows} rows"
    if why:
        plan.replicated.append(f"{path} ({kind}: {why})")
    else:
        plan.embeddings.append(path)


def _add_experts(plan: TPPlan, path: str, module: nn.Module, count: int, degree: int) -> None:
    """Split a mixture of experts by experts (`tp_styles.ExpertsSharded`), or name why its experts stay whole."""
    kind = type(module).__name__
    own = list(module.parameters(recurse=False))
    why = ""
    if not hasattr(module, "_is_expert_parallel") or getattr(module, "num_experts", None) != count:
        why = ("its forward is not one of transformers' experts implementations, which skip the experts of other "
               "ranks")
    elif any(p.dim() != 3 or p.shape[0] != count for p in own):
        why = "not all of its weights are stacked by expert"
    elif count % degree:
        why = f"{degree} does not divide its {count} experts"
    if why:
        plan.replicated.append(f"{path} ({kind}: {count} experts, all kept on every rank: {why})")
    else:
        plan.experts.append(path)


def tp_plan(model: nn.Module, degree: int) -> TPPlan:
    """The tensor-parallel plan of a model at a degree (see the module docstring)."""
    plan = TPPlan()
    covered: set[str] = set()
    for parent_name, parent in model.named_modules():
        linears = [(name, child) for name, child in parent.named_children() if features(child) is not None]
        cols = [(n, c) for n, c in linears if n in COLWISE]
        rows = [(n, c) for n, c in linears if n in ROWWISE]
        if cols and rows:
            path = (parent_name + ".") if parent_name else ""
            _add_pair(plan, covered, [(path + n, c) for n, c in cols], [(path + n, r) for n, r in rows],
                      parent_name, parent, degree)
    for parent_name, parent in model.named_modules():  # the BERT family's pairs sit in sibling modules
        for cols, rows, owner_name, owner in _sibling_pairs(parent_name, parent):
            if not covered & {path for path, _ in cols + rows}:
                _add_pair(plan, covered, cols, rows, owner_name, owner, degree)
    tied = _tied(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and name:
            _add_table(plan, name, module, degree, tied)
            covered.add(name)
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and name not in covered and not any(name.startswith(c + ".") for c in covered):
            stacked = [p for p in own if p.dim() == 3]  # a mixture of experts' weights, one slice per expert
            if stacked:
                _add_experts(plan, name, module, stacked[0].shape[0], degree)
            else:
                plan.replicated.append(f"{name} ({type(module).__name__})")
    if not plan.colwise and not plan.embeddings and not plan.experts:
        kinds = sorted({entry.split("(")[-1].rstrip(")") for entry in plan.replicated})
        plan.reason = ("no attention or MLP projection pairs (a colwise layer followed by a rowwise one) and no "
                       "embedding tables it can split were found; "
                       f"layers it cannot split: {', '.join(kinds) or 'none with parameters'}")
    return plan
