"""GPU smoke check (needs one NVIDIA GPU, two for the NCCL hang check; runs in well under two minutes).

A local mesh with one rank and NCCL: the rank sees cuda:0, an all_reduce of a CUDA
tensor works, a CUDA tensor pushed lands on the rank's GPU and pulled lands in the
notebook's host memory (or on a named device), and a 64 MiB pull from the GPU is timed
against the rank's own GPU-to-host copy. Prints one line per check and exits non-zero on
the first failure.

    python benchmarks/gpu_smoke.py
"""

from __future__ import annotations

import sys
import time

import torch

import monarch_kernel


def check(name: str, ok: bool, detail: str = "") -> None:
    """Print a check's outcome; stop on failure."""
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    check("host has a CUDA GPU", torch.cuda.is_available(), f"{torch.cuda.device_count()} device(s)")
    start = time.perf_counter()
    with monarch_kernel.local_mesh(gpus=1, dist="nccl", name="gpu-smoke") as mesh:
        check("mesh up with nccl", True, f"{time.perf_counter() - start:.2f} s")
        device = mesh.run("import torch\nstr(torch.cuda.current_device()), torch.cuda.get_device_name()").item(hosts=0, gpus=0)
        check("rank uses cuda:0", device[0] == "0", f"{device}")
        reduced = mesh.run("import torch, torch.distributed as dist\nt = torch.full((4,), 2.0, device='cuda')\n"
                           "dist.all_reduce(t)\n(dist.get_backend(), t.device.type, t.tolist())").item(hosts=0, gpus=0)
        check("all_reduce of a CUDA tensor", reduced == ("nccl", "cuda", [2.0] * 4), str(reduced))
        x = torch.randn(1 << 20, device="cuda")
        t = time.perf_counter()
        mesh.push(x=x)
        back = mesh.pull("x").item(hosts=0, gpus=0)
        elapsed = time.perf_counter() - t
        on_rank = mesh.pull("(x.device.type, x.device.index)").item(hosts=0, gpus=0)
        check("push lands on the rank's GPU", on_rank == ("cuda", 0), str(on_rank))
        check("pull of a CUDA tensor lands in the notebook's host memory", back.device.type == "cpu"
              and torch.equal(back, x.cpu()), f"4 MiB push+pull in {elapsed * 1e3:.1f} ms")
        on_gpu = mesh.pull("x", device="cuda:0").item(hosts=0, gpus=0)
        check("pull(device='cuda:0') puts it on the GPU", on_gpu.is_cuda and torch.equal(on_gpu, x))
        _pull_speed(mesh)
        _actor_threads_use_the_ranks_device(mesh)
        stats = mesh.run("import torch\ntorch.cuda.memory_allocated()").item(hosts=0, gpus=0)
        check("rank reports GPU memory", stats > 0, f"{stats} bytes allocated")
        try:
            import pynvml  # noqa: F401  (pip install monarch-kernel[gpu])
        except ImportError:
            print("SKIP  mesh view GPU columns: nvidia-ml-py is not installed", flush=True)
        else:
            from monarch_kernel.views.meshview import mesh_snapshot, snapshot_text

            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not mesh_snapshot(mesh).has_gpu:
                time.sleep(0.2)
            snap = mesh_snapshot(mesh)
            cell = snap.cells()[0]
            check("mesh view shows GPU memory and utilization", snap.has_gpu and bool(cell.gpu_total_bytes),
                  snapshot_text(snap).splitlines()[-1])
    _nccl_hang(torch.cuda.device_count())
    print("gpu smoke: all checks passed")


class _Devices(monarch_kernel.Actor):
    @monarch_kernel.endpoint
    def hold(self, seconds: float) -> None:
        time.sleep(seconds)

    @monarch_kernel.endpoint
    def device(self) -> tuple[bool, int, str]:
        import threading

        made = torch.ones(1, device="cuda")
        return threading.current_thread() is threading.main_thread(), torch.cuda.current_device(), str(made.device)


def _actor_threads_use_the_ranks_device(mesh) -> None:
    """A sync endpoint that runs beside the main thread (on its actor's own thread) uses the rank's GPU."""
    holder, other = mesh.spawn("gpu_holder", _Devices), mesh.spawn("gpu_other", _Devices)
    held = holder.hold.call(2.0)
    time.sleep(0.2)
    on_main, current, made = other.device.call_one().get(timeout=30)
    held.get(timeout=30)
    rank_device = mesh.run("import torch\ntorch.cuda.current_device()").item(hosts=0, gpus=0)
    check("an endpoint on its actor's own thread uses the rank's GPU",
          not on_main and current == rank_device and made == f"cuda:{rank_device}", f"{made} (main thread: {on_main})")


HANG = ("import time, torch, torch.distributed as dist\nt = torch.ones(4, device='cuda')\n"
        "if dist.get_rank() == 1:\n    time.sleep(60)\ndist.all_reduce(t)\ntorch.cuda.synchronize()")


def _nccl_hang(gpus: int) -> None:
    """Hang diagnosis on NCCL (issue 29): rank 1 sleeps while rank 0 waits in all_reduce; the verdict
    names both, and a stop frees both ranks with a fresh group. NCCL puts one rank on each GPU: 2 needed."""
    if gpus < 2:
        print("SKIP  NCCL hang verdict and stop: needs 2 GPUs (NCCL takes one per rank)", flush=True)
        return
    with monarch_kernel.local_mesh(gpus=2, dist="nccl", name="gpu-hang") as mesh:
        running = mesh.run_async(HANG)
        deadline, verdict = time.monotonic() + 30, ""
        while time.monotonic() < deadline and "wait in all_reduce" not in verdict:
            time.sleep(1)
            verdict = str(mesh.why())
        check("NCCL straggler verdict", "rank 0 wait in all_reduce" in verdict and "rank 1 has not entered" in verdict,
              verdict.splitlines()[0] if verdict else "")
        stopped = time.perf_counter()
        try:
            running.get(timeout=1)  # the wait times out: the cell is stopped on both ranks, as the stop button does
        except monarch_kernel.MeshTimeoutError as exc:
            print(f"      the stopped cell: {str(exc).splitlines()[0]}", flush=True)
        after = mesh.run("import torch, torch.distributed as dist\nt = torch.ones(4, device='cuda')\n"
                         "dist.all_reduce(t)\nt.sum().item()", timeout=60)
        check("after a stop, the next NCCL all_reduce works on both ranks", list(after.values()) == [8.0, 8.0],
              f"{time.perf_counter() - stopped:.1f} s after the stop")


def _pull_speed(mesh) -> None:
    """A 64 MiB CUDA tensor pulled from the rank (one copy: the GPU into shared memory), against
    the floor of the same GPU-to-host copy on the rank into fresh memory (`t.cpu()`), same run."""
    mesh.run("import torch, time\nbig = torch.randn(16 << 20, device='cuda')\ntorch.cuda.synchronize()")
    pulls = []
    for _ in range(7):
        t = time.perf_counter()
        value = mesh.pull("big").item(hosts=0, gpus=0)
        pulls.append(time.perf_counter() - t)
        del value
    floor = mesh.run("times = []\nfor _ in range(7):\n    t = time.perf_counter()\n    big.cpu()\n"
                     "    times.append(time.perf_counter() - t)\nsorted(times)[3]").item(hosts=0, gpus=0)
    gbps = (64 << 20) / sorted(pulls)[3] / 1e9
    floor_gbps = (64 << 20) / floor / 1e9
    check("pull of 64 MiB from the GPU", gbps > 0, f"{gbps:.2f} GB/s; the rank's own big.cpu(): {floor_gbps:.2f} GB/s "
          f"({gbps / floor_gbps:.2f}x of that floor)")


if __name__ == "__main__":
    main()
