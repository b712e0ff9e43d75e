"""Workspace sync and put on the SSH test hosts (needs root and rsync), against rsync and scp in the same run.

A project tree of 2,000 files and 200 MB (1,990 small files, 10 large ones, random
bytes) is synced to 2 hosts: the first sync to empty copies, and a re-sync with nothing
changed, against `rsync -a` over `ssh` to the same hosts (both hosts at once, as ours;
the floor), plus the stat walk alone and the auto-sync check a cell pays when nothing
changed. Then `put` of a 1 GB file to one host against `scp`. Ray's `working_dir` upload
needs a Ray cluster on the hosts and is not measured (see the README).

    sudo .venv/bin/python benchmarks/bench_workspace.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import NullSink, format_seconds  # noqa: E402

FILES, TOTAL = 2000, 200 << 20


def make_tree(root: str) -> None:
    """1,990 files of about 10 KiB in 40 folders, and 10 files sharing the rest of 200 MiB."""
    small = 10 << 10
    for i in range(FILES - 10):
        folder = os.path.join(root, "pkg", f"sub{i % 40}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"mod{i}.py"), "wb") as f:
            f.write(os.urandom(small))
    big = (TOTAL - (FILES - 10) * small) // 10
    os.makedirs(os.path.join(root, "assets"), exist_ok=True)
    for i in range(10):
        with open(os.path.join(root, "assets", f"blob{i}.bin"), "wb") as f:
            f.write(os.urandom(big))


def median(fn, n: int, setup=None) -> float:
    times = []
    for _ in range(n):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from sshhosts import SSHTestHosts, unavailable_reason

    if unavailable_reason():
        sys.exit(f"cannot make SSH test hosts here: {unavailable_reason()}")
    if shutil.which("rsync") is None:
        sys.exit("rsync is missing (apt-get install rsync): it is the floor this benchmark compares with")
    import monarch_kernel
    from monarch_kernel.api import workspace
    from monarch_kernel.controller.workspace_sync import scan
    from monarch_kernel.core.workspace import workspace_key

    rounds = 1 if args.quick else 3
    work = tempfile.mkdtemp(prefix="bench-ws-")
    tree = os.path.join(work, "project")
    make_tree(tree)
    os.makedirs(os.path.join(work, "hosts"))
    hosts = SSHTestHosts(2, os.path.join(work, "hosts"), scratch_size="3g").start()
    rows: dict[str, tuple[float, float | None]] = {}
    try:
        mesh = monarch_kernel.ssh_mesh([h.alias for h in hosts.hosts], gpus=1, dist="none", python=sys.executable,
                                       connect_options=hosts.connect_options(), name="bench-ws")
        copies = [os.path.join(hosts.workspaces(h), workspace_key(tree)) for h in hosts.hosts]
        ssh = ["ssh", "-F", hosts.config, "-o", "BatchMode=yes"]

        # rsync writes where our copies go, on the same disk (each host's own workspace folder)
        rsync_copies = [os.path.join(hosts.workspaces(h), "rsync-copy") for h in hosts.hosts]

        def clear_copies() -> None:
            for copy in copies + rsync_copies:
                shutil.rmtree(copy, ignore_errors=True)
            subprocess.run(["sync"], check=True)  # both start with nothing waiting to be written

        def ours() -> None:
            mesh.sync_workspace(tree, force=True)

        def rsync_both() -> None:
            procs = [subprocess.Popen(["rsync", "-a", "-e", " ".join(ssh), tree + "/", f"{h.alias}:{copy}/"],
                                      stdout=subprocess.DEVNULL)
                     for h, copy in zip(hosts.hosts, rsync_copies)]
            assert all(p.wait() == 0 for p in procs)

        first_ours, first_rsync = [], []
        for i in range(rounds):  # alternate who goes first
            for fn, out in ([(ours, first_ours), (rsync_both, first_rsync)][::1 if i % 2 == 0 else -1]):
                clear_copies()
                out.append(median(fn, 1))
        rows["first sync, 2 hosts"] = (statistics.median(first_ours), statistics.median(first_rsync))
        rows["re-sync, nothing changed"] = (median(ours, 10 if not args.quick else 3),
                                            median(rsync_both, 5 if not args.quick else 2))
        rows["stat walk of the tree (scan)"] = (median(lambda: scan(tree), 20), None)
        mesh.sync_workspace(tree, force=True, auto=True)
        rows["auto-sync check before a cell"] = (median(lambda: workspace.sync_changed(mesh._runtime), 20), None)
        mesh.shutdown()

        one = monarch_kernel.ssh_mesh([hosts.hosts[1].alias], gpus=1, dist="none", python=sys.executable,
                                      connect_options=hosts.connect_options(), name="bench-put")
        gigabyte = os.path.join(work, "one-gb.bin")
        with open(gigabyte, "wb") as f:
            for _ in range(125):
                f.write(os.urandom(8_000_000))
        target = f"{hosts.scratch}/put/one-gb.bin"

        def clean() -> None:  # the host's scratch disk holds one copy at a time
            one.run(f"import glob, os\nfor p in glob.glob({hosts.scratch + '/**/one-gb*'!r}, recursive=True): "
                    "os.unlink(p)", sink=NullSink())

        def put() -> None:
            one.put(gigabyte, target)

        def scp() -> None:
            subprocess.run(["scp", "-q", "-F", hosts.config, "-o", "BatchMode=yes", gigabyte,
                            f"{hosts.hosts[1].alias}:{hosts.scratch}/one-gb.scp"], check=True)

        rows["put 1 GB to a host"] = (median(put, rounds, clean), median(scp, rounds, clean))
        one.shutdown()
    finally:
        hosts.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"{FILES} files, {TOTAL >> 20} MiB; 2 SSH test hosts (medians; {rounds} round(s) of first syncs)\n")
    print("| | monarch-kernel | rsync -a / scp (floor) | ours / floor |")
    print("|---|---|---|---|")
    for name, (mine, floor) in rows.items():
        if name.startswith("put"):
            cells = f"{1e9 / mine / 1e9:.2f} GB/s | {1e9 / floor / 1e9:.2f} GB/s | {floor / mine:.2f}x speed" \
                if floor else ""
        else:
            cells = f"{format_seconds(mine)} | " + (f"{format_seconds(floor)} | {mine / floor:.2f}x time"
                                                     if floor is not None else "- | -")
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
