"""Persistent meshes: how long a new kernel takes to get back to work on a model the ranks already hold.

Libraries are imported before the clock starts (a kernel imports them when it starts: `%load_ext`).
Each system first gets 4 workers holding a 256 MiB model each, from a "first kernel" process that then
goes away. Then, in fresh interpreters (a restarted kernel), we time getting the model back and running a
first cell on it:

- ours, persistent: `attach(name)` + a cell that uses the model (the ranks kept it);
- ours, without persist: `local_mesh(4)` + each rank loads the model from its checkpoint (`torch.load`)
  + the same cell: what a restart costs without persistence (the floor of reloading);
- IPython Parallel: its engines outlive a client: `Cluster.from_file()` + connect + wait for the 4
  engines + the same cell. (PyTorch Monarch re-attaches to an allocation, but a dead client's actors are
  gone with it: its row would be the reload row.)

    python benchmarks/bench_persist.py [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKERS = 4
FLOATS = (256 << 20) // 4
USE = "float(model.sum())"
HERE = os.path.abspath(__file__)


def first_ours(folder: str) -> None:
    import monarch_kernel

    mesh = monarch_kernel.local_mesh(WORKERS, dist="gloo", name="bench-persist", persist="10m")
    mesh.run(f"import torch\nmodel = torch.randn({FLOATS})")
    print("READY", flush=True)


def again_ours(folder: str) -> float:
    import monarch_kernel
    import monarch_kernel.api.persistent  # noqa: F401 - (what %load_ext imports when the kernel starts)

    t = time.perf_counter()
    mesh = monarch_kernel.attach("bench-persist")
    mesh.run(USE)
    return time.perf_counter() - t


def again_reload(folder: str) -> float:
    import monarch_kernel
    import monarch_kernel.api.starting  # noqa: F401

    path = os.path.join(folder, "model.pt")
    if not os.path.exists(path):
        import torch

        torch.save(torch.randn(FLOATS), path)
    t = time.perf_counter()
    mesh = monarch_kernel.local_mesh(WORKERS, dist="gloo")
    mesh.run(f"import torch\nmodel = torch.load({path!r})")
    mesh.run(USE)
    took = time.perf_counter() - t
    mesh.shutdown()
    return took


def first_ipyparallel(folder: str) -> None:
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=WORKERS, log_level=40, cluster_id="bench-persist", shutdown_atexit=False)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(WORKERS, timeout=120)
    rc[:].execute(f"import torch\nmodel = torch.randn({FLOATS})", block=True)
    print("READY", flush=True)


def again_ipyparallel(folder: str) -> float:
    import ipyparallel as ipp

    t = time.perf_counter()
    cluster = ipp.Cluster.from_file(cluster_id="bench-persist")
    rc = cluster.connect_client_sync()
    rc.wait_for_engines(WORKERS, timeout=60)
    rc[:].execute(USE, block=True)
    return time.perf_counter() - t


def stop_ipyparallel() -> None:
    import ipyparallel as ipp

    ipp.Cluster.from_file(cluster_id="bench-persist").stop_cluster_sync()


def child(role: str, system: str, folder: str) -> None:
    if role == "first":
        {"ours": first_ours, "ipyparallel": first_ipyparallel}[system](folder)
        os._exit(0)  # a kernel that goes away without cleaning up
    took = {"ours": again_ours, "reload": again_reload, "ipyparallel": again_ipyparallel}[system](folder)
    print(json.dumps({"seconds": took}), flush=True)
    os._exit(0)


def run(role: str, system: str, folder: str) -> dict:
    done = subprocess.run([sys.executable, HERE, "--child", role, system, folder], capture_output=True, text=True,
                          timeout=600)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
        if line == "READY":
            return {}
    return {"skipped": (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
        return
    rounds = 2 if "--quick" in sys.argv else 5
    folder = tempfile.mkdtemp(prefix="bench-persist-")
    results: dict[str, list[float] | str] = {}
    started = run("first", "ours", folder)
    results["ours: attach + first cell"] = [run("again", "ours", folder)["seconds"] for _ in range(rounds)] \
        if "skipped" not in started else str(started["skipped"])
    subprocess.run([sys.executable, "-m", "monarch_kernel", "meshes", "stop", "bench-persist"], capture_output=True)
    results["ours without persist: up + torch.load + first cell"] = [run("again", "reload", folder)["seconds"]
                                                                     for _ in range(rounds)]
    try:
        import ipyparallel  # noqa: F401
    except ImportError:
        results["IPython Parallel: reconnect + first cell"] = "ipyparallel is not installed (pip install -e .[bench])"
    else:
        started = run("first", "ipyparallel", folder)
        try:
            results["IPython Parallel: reconnect + first cell"] = (
                [run("again", "ipyparallel", folder).get("seconds", float("nan")) for _ in range(rounds)]
                if "skipped" not in started else str(started["skipped"]))
        finally:
            stop_ipyparallel()
    print(f"back to work after a kernel restart: {WORKERS} workers holding a 256 MiB model each "
          f"(median of {rounds}, fresh interpreter each time)")
    ours = results["ours: attach + first cell"]
    for row, data in results.items():
        if isinstance(data, str):
            print(f"  {row:55} skipped: {data}")
            continue
        median = statistics.median(data)
        ratio = f"   ours {statistics.median(ours) / median:.3f}x its time" if isinstance(ours, list) and data is not ours else ""
        print(f"  {row:55} {median * 1e3:9.1f} ms{ratio}")


if __name__ == "__main__":
    main()
