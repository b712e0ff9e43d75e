"""A private munged for tests: the real daemon, on a socket in a folder of the test's own.

One munged serves every process that names its socket (`MONARCH_KERNEL_MUNGE_SOCKET`, or a
slurm.conf's `AuthInfo=socket=`), in any network namespace: Unix sockets are shared across them.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time

MUNGED = "/usr/sbin/munged"


def unavailable_reason() -> str | None:
    """Why a munged cannot be started here (None when it can)."""
    if os.geteuid() != 0:
        return "a private munged needs root (it runs as the munge user)"
    for tool in (MUNGED, "/usr/bin/munge", "/usr/bin/unmunge", "/usr/bin/setpriv"):
        if not os.path.exists(tool):
            return f"{tool} is missing (apt-get install munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge user does not exist (install munge)"
    return None


class PrivateMunged:
    """munged on `folder/munge.sock` with a fresh key; a context manager (stopped on exit, even after a failure)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.socket = os.path.join(folder, "munge.sock")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateMunged:
        munge = pwd.getpwnam("munge")
        os.makedirs(self.folder, exist_ok=True)
        key = os.path.join(self.folder, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        for path, mode in ((self.folder, 0o755), (key, 0o400)):
            os.chown(path, munge.pw_uid, munge.pw_gid)
            os.chmod(path, mode)
        parent = os.path.dirname(self.folder)
        os.chmod(parent, os.stat(parent).st_mode | 0o711)  # munge must reach its folder inside ours
        with open(os.path.join(self.folder, "munged.out"), "ab") as log:
            self._proc = subprocess.Popen(
                ["setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}", "--clear-groups", MUNGED,
                 "--foreground", f"--socket={self.socket}", f"--key-file={key}",
                 f"--pid-file={self.folder}/munged.pid", f"--log-file={self.folder}/munged.log",
                 f"--seed-file={self.folder}/munged.seed"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.socket):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"munged did not start (see {self.folder}/munged.log)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._proc = None

    def __enter__(self) -> PrivateMunged:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
