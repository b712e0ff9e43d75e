"""A layout: how the ranks of a mesh split a model (data parallel, fully sharded, tensor
parallel, pipeline stages), which of its blocks recompute their activations in the backward
(activation checkpointing, `ac=K`: every K-th block; `ac=1`: every block), and in what precision it
computes (`mp=bf16`: mixed precision, bf16 compute on fp32 master weights with fp32 gradient reduction).

Written as a short string, `"ddp=4"`, `"fsdp=4"`, `"tp=4"`, `"fsdp=2,tp=2"`, `"ddp=2,tp=2"`,
`"pp=2,fsdp=2"`, `"pp=4"`: the degrees multiply to the number of ranks. Tensor parallelism stays
inside a host (its collectives run on every layer); the data-parallel dimension spans hosts.
Pipeline stages are the outer dimension (rank = stage x data-parallel degree + data-parallel
index), so a stage's data-parallel ranks sit together and only activations cross between stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

STRATEGIES = ("ddp", "fsdp", "tp", "pp")
POLICIES = ("ac",)  # asked for as strategies too: `strategies=(..., "ac")` plans each layout also with ac=1
PRECISIONS = ("fp32", "bf16")  # what a plan's `precision=` takes: as built, or bf16 mixed precision (mp=bf16)
TP = " (tp)"  # an estimate's collective kinds run on the tensor-parallel group end so ("all_gather (tp)")


@dataclass(frozen=True)
class Layout:
    """Degrees of each kind of parallelism (1: not used); ddp and fsdp exclude each other, and
    pipeline stages are not combined with tensor parallelism."""

    ddp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    ac: int = 0  # activation checkpointing: every ac-th block recomputes its activations (0: none)
    mp: str = ""  # mixed precision: "bf16" computes in bf16 on fp32 master weights ("": as the model is built)

    def __post_init__(self) -> None:
        if min(self.ddp, self.fsdp, self.tp, self.pp) < 1 or self.ac < 0:
            raise ValueError(f"degrees must be at least 1 (ac at least 0): {self}")
        if self.mp not in ("", "bf16"):
            raise ValueError(f"mixed precision {self.mp!r}: only bf16 is planned (fp16 needs loss scaling)")
        if self.mp and self.pp > 1:
            raise ValueError("mixed precision combines with DDP, FSDP and TP layouts, not with pipelines")
        if self.ac and self.pp > 1:
            raise ValueError("activation checkpointing combines with DDP, FSDP and TP layouts, not with pipelines")
        if self.ddp > 1 and self.fsdp > 1:
            raise ValueError("a layout shards data either with DDP or with FSDP, not both")
        if self.pp > 1 and self.tp > 1:
            raise ValueError("pipeline stages combine with DDP or FSDP, not with tensor parallelism")

    @property
    def world(self) -> int:
        """The number of ranks it needs."""
        return self.ddp * self.fsdp * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """How many ways the global batch is split."""
        return self.ddp * self.fsdp

    @property
    def text(self) -> str:
        """`"fsdp=2,tp=2"`."""
        degrees = (("pp", self.pp), ("ddp", self.ddp), ("fsdp", self.fsdp), ("tp", self.tp))
        parts = [f"{name}={degree}" for name, degree in degrees if degree > 1] or ["ddp=1"]
        return ",".join(parts + ([f"ac={self.ac}"] if self.ac else []) + ([f"mp={self.mp}"] if self.mp else []))

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> Layout:
        """The layout a string names (`"fsdp=2,tp=2"`)."""
        degrees: dict[str, int] = {}
        precision = ""
        for part in text.replace(" ", "").split(","):
            name, _, value = part.partition("=")
            if name == "mp" and value:
                precision = value
                continue
            if name not in STRATEGIES + POLICIES or not value.isdigit():
                raise ValueError(f"{text!r} is not a layout: write it as ddp=N, fsdp=N, tp=N, pp=N or "
                                 "combinations such as fsdp=A,tp=B and pp=A,fsdp=B, with ac=K to recompute "
                                 "every K-th block's activations and mp=bf16 for mixed precision")
            degrees[name] = int(value)
        return cls(**degrees, mp=precision)

    def with_precision(self, precision: str) -> Layout:
        """This layout computing in `precision` (one of PRECISIONS: "fp32" as built, "bf16" mixed)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
        return replace(self, mp="" if precision == "fp32" else precision)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _with_data_parallel(rest: int, strategies: tuple[str, ...], **degrees: int) -> list[Layout]:
    """A layout of `degrees` with the remaining `rest` ranks data parallel (DDP or FSDP, as allowed)."""
    base = Layout(tp=degrees.get("tp", 1), pp=degrees.get("pp", 1))
    if rest == 1:
        return [base]
    return ([replace(base, ddp=rest)] if "ddp" in strategies else []) + (
        [replace(base, fsdp=rest)] if "fsdp" in strategies else [])


def candidate_layouts(hosts: int, gpus: int, strategies: tuple[str, ...] = STRATEGIES) -> list[Layout]:
    """Every sensible layout of `hosts` x `gpus` ranks with the given strategies, simplest first.

    Tensor parallelism takes a divisor of the ranks per host (never across hosts); pipeline stages
    any divisor of the ranks; the rest is data parallel, replicated (DDP) or fully sharded (FSDP).
    """
    world = hosts * gpus
    found: list[Layout] = []
    for pp in _divisors(world)[1:] if "pp" in strategies else []:
        found += _with_data_parallel(world // pp, strategies, pp=pp)
    for tp in _divisors(gpus):
        if tp == 1 or "tp" in strategies:
            found += _with_data_parallel(world // tp, strategies, tp=tp)
    if world == 1:
        found = [Layout()]
    if "ac" in strategies:
        found += [replace(layout, ac=1) for layout in found if layout.pp == 1]
    return sorted(set(found), key=lambda layout: (layout.pp, layout.tp, layout.fsdp > 1, layout.ddp, layout.ac))
