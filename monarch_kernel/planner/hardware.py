"""What the ranks can do: memory, FLOP/s and link bandwidth, known or measured, and the time of a
step from the FLOPs and collective bytes of an estimate.

For a cluster you do not have yet, `ACCELERATORS` gives round vendor figures (dense, no
sparsity) that `device=` picks by name; pass an `Accelerator` of your own to override them.
On a live mesh the figures are measured instead (`measure.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GiB = 1 << 30
LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporary", "buffers")  # of a rank's memory


@dataclass(frozen=True)
class Accelerator:
    """One rank's device: memory, dense FLOP/s by dtype, and link bandwidth in bytes/s."""

    name: str
    memory: int
    flops_bf16: float
    flops_fp32: float
    intra_host_bandwidth: float  # between the devices of one host (NVLink, PCIe)
    inter_host_bandwidth: float  # per device between hosts (InfiniBand, Ethernet)

    def flops(self, dtype_bytes: int) -> float:
        """FLOP/s for parameters of this many bytes (2: bf16/fp16, 4: fp32)."""
        return self.flops_bf16 if dtype_bytes <= 2 else self.flops_fp32


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("H200", 141 * GiB, 989e12, 67e12, 450e9, 50e9),
    Accelerator("H100", 80 * GiB, 989e12, 67e12, 450e9, 50e9),
    Accelerator("A100-80GB", 80 * GiB, 312e12, 19.5e12, 300e9, 25e9),
    Accelerator("A100-40GB", 40 * GiB, 312e12, 19.5e12, 300e9, 25e9),
    Accelerator("L40S", 48 * GiB, 362e12, 91.6e12, 32e9, 12.5e9),
    Accelerator("MI300X", 192 * GiB, 1307e12, 163e12, 448e9, 50e9),
)}


def accelerator(device: str | Accelerator, memory: int | None = None) -> Accelerator:
    """The figures of a device named in ACCELERATORS (case-insensitive), or the one given."""
    if isinstance(device, Accelerator):
        found = device
    else:
        matches = [a for name, a in ACCELERATORS.items() if name.lower() == device.lower()]
        if not matches:
            raise ValueError(f"unknown device {device!r}: known are {', '.join(ACCELERATORS)}; "
                             "or pass Accelerator(name, memory, flops_bf16, flops_fp32, intra, inter)")
        found = matches[0]
    return found if memory is None else replace(found, memory=memory)


def parse_bytes(text: str | int) -> int:
    """`"20GiB"`, `"512MB"`, `"80GB"` or a number of bytes."""
    if isinstance(text, int):
        return text
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    clean = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if clean.endswith(unit) and clean[:-len(unit)].replace(".", "", 1).isdigit():
            return int(float(clean[:-len(unit)]) * scale)
    if clean.isdigit():
        return int(clean)
    raise ValueError(f"{text!r} is not a size: write bytes, or a number with KiB, MiB, GiB (or KB, MB, GB)")


def size_text(size: float) -> str:
    """Bytes in binary units, three figures."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} B"


def bus_factor(kind: str, ranks: int) -> float:
    """The share of a buffer that crosses each rank's link in a ring of `ranks` (all of it for send/recv)."""
    if kind == "send_recv":
        return 1.0
    return (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks


def ring_hops(kind: str, ranks: int) -> int:
    """The sequential steps of a ring collective over `ranks` (each pays one hop's latency)."""
    if ranks <= 1:
        return 0
    if kind == "send_recv":
        return 1
    return (2 if kind == "all_reduce" else 1) * (ranks - 1)


def collective_seconds(kind: str, size: int, group: int, bandwidth: float) -> float:
    """Ring-algorithm time of one rank's collectives of `size` bytes in a group of `group` ranks."""
    if group <= 1 or size <= 0:
        return 0.0
    return bus_factor(kind, group) * size / bandwidth


@dataclass
class Figures:
    """What a rank can do: memory to use, FLOP/s, link bandwidths (measured or known)."""

    memory: int
    flops: float  # fp32 matmul FLOP/s
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    source: str  # "measured on mesh NAME" or the accelerator's name
    flops_bf16: float = 0.0  # bf16 matmul FLOP/s (0: as fp32)
    latency: float = 10e-6  # of one collective, in seconds
    op_overhead: float = 5e-6  # per dispatched operator (a GPU's kernel launch, a CPU's dispatch)
    dtensor_overhead: float = 30e-6  # more per operator on DTensors (sharding propagation, in Python)
    # measured: {"intra" | "inter": {LINK_KINDS: [latency s, bus bandwidth bytes/s, ranks measured over]}}
    links: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def compute_rate(self, dtype_bytes: int) -> float:
        """FLOP/s when computing in a dtype of this many bytes (2: bf16/fp16, 4: fp32)."""
        return self.flops_bf16 if dtype_bytes <= 2 and self.flops_bf16 > 0 else self.flops

    def link(self, kind: str, across_hosts: bool, ranks: int) -> tuple[float, float]:
        """(latency of one call, bus bandwidth) of a kind of collective over `ranks`, inside a host
        or across hosts: measured where the mesh measured it (the latency scaled by the ring's
        steps), else this figure's latency and bandwidths."""
        kind = kind if kind in LINK_KINDS else "all_reduce"
        scope = "inter" if across_hosts else "intra"
        found = self.links.get(scope, {}).get(kind)
        if found is None:
            return self.latency, self.inter_host_bandwidth if across_hosts else self.intra_host_bandwidth
        latency, bandwidth, measured_over = found
        per_hop = latency / max(1, ring_hops(kind, int(measured_over)))
        return per_hop * ring_hops(kind, ranks), bandwidth
