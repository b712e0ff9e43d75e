"""What each rank costs its host: CPU %, resident memory and, with NVML, its GPU.

The host agent samples its own ranks once a second (from /proc, and from NVML when
nvidia-ml-py is installed and a GPU is present) and sends one message per host.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class RankLoad:
    """One rank's load; GPU fields are None where there is no GPU (or no NVML)."""

    rank: int
    cpu_percent: float
    rss_bytes: int
    gpu_used_bytes: int | None = None
    gpu_total_bytes: int | None = None
    gpu_util_percent: float | None = None
    activity: str = ""  # the endpoint its actors run, e.g. "Trainer.step 1.5s"
    collective: str = ""  # the collective its main thread waits in, e.g. "in all_reduce #58 (default group) for 31s"
    host_memory_bytes: int | None = None  # the host's memory in all (MemTotal), to scale rss against


class LoadSampler:
    """Turns successive /proc readings into CPU percentages; asks NVML about GPUs."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (wall time, cpu seconds)
        self._nvml = _nvml()
        self._memory = _host_memory()

    def sample(self, ranks: dict[int, tuple[int, int]], activity: dict[int, str] | None = None,
               collective: dict[int, str] | None = None) -> list[RankLoad]:
        """Loads of {rank: (pid, local_rank)}; ranks whose /proc entry vanished are skipped."""
        now = time.monotonic()
        loads = []
        for rank, (pid, local_rank) in sorted(ranks.items()):
            cpu_s, rss = _proc(pid)
            if cpu_s is None:
                continue
            before = self._last.get(pid)
            self._last[pid] = (now, cpu_s)
            percent = 0.0 if before is None or now <= before[0] else 100.0 * (cpu_s - before[1]) / (now - before[0])
            gpu = self._gpu(local_rank)
            loads.append(RankLoad(rank, round(max(0.0, percent), 1), rss, *gpu, (activity or {}).get(rank, ""),
                                  (collective or {}).get(rank, ""), self._memory))
        alive = {pid for pid, _ in ranks.values()}
        for pid in list(self._last):
            if pid not in alive:
                del self._last[pid]
        return loads

    def _gpu(self, index: int) -> tuple[int | None, int | None, float | None]:
        if self._nvml is None:
            return None, None, None
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            return int(memory.used), int(memory.total), float(util.gpu)
        except Exception:  # noqa: BLE001 - no such device, or NVML went away
            return None, None, None


def _proc(pid: int) -> tuple[float | None, int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/statm", "rb") as f:
            resident = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None, 0
    return (int(fields[11]) + int(fields[12])) / _TICKS, resident * _PAGE


def _host_memory() -> int | None:
    """MemTotal of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _nvml():
    """The NVML module, initialised, if nvidia-ml-py is installed and a driver answers."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no GPU
        return None
    return pynvml
