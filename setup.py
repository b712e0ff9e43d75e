"""Build hook for the JupyterLab sidebar (everything else is in pyproject.toml).

The TypeScript extension in labextension/ is built (npm + jupyter-builder) into
monarch_kernel/labextension/ whenever its sources are newer than the build, and that build is
installed under share/jupyter/labextensions/, where JupyterLab finds prebuilt extensions: users
of the wheel never need Node. Without npm the build is skipped with a warning (the kernel side
works without it) unless MONARCH_KERNEL_REQUIRE_LABEXTENSION=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "labextension"
BUILT = HERE / "monarch_kernel" / "labextension"
EXTENSION = "monarch-kernel-meshes"
SHARE = f"share/jupyter/labextensions/{EXTENSION}"


def _sources() -> list[Path]:
    files = [SOURCE / "package.json", SOURCE / "tsconfig.json"]
    for folder in ("src", "style"):
        files += [p for p in (SOURCE / folder).rglob("*") if p.is_file()]
    return [p for p in files if p.exists()]


def _stale() -> bool:
    marker = BUILT / "package.json"
    if not marker.exists():
        return True
    return max(p.stat().st_mtime for p in _sources()) > marker.stat().st_mtime


def _say(message: str) -> None:
    print(f"monarch-kernel: {message}", file=sys.stderr, flush=True)


def build_labextension() -> None:
    """Build the extension if its sources changed (and npm is there to build it)."""
    if not (SOURCE / "package.json").exists() or not _stale():
        return
    npm = shutil.which("npm")
    if npm is None:
        message = ("npm not found: the JupyterLab Meshes sidebar is not built (install Node.js 20+ "
                   "and reinstall to get it; the kernel extension works without it)")
        if os.environ.get("MONARCH_KERNEL_REQUIRE_LABEXTENSION") == "1":
            raise SystemExit(message)
        _say(message)
        return
    if not (SOURCE / "node_modules").exists():
        _say("installing the JupyterLab extension's build tools (npm ci)")
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=SOURCE, check=True)
    _say("building the JupyterLab Meshes sidebar")
    env = dict(os.environ)
    # jupyter-builder comes with the build environment (build-system.requires)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    subprocess.run([npm, "run", "build:prod"], cwd=SOURCE, check=True, env=env)
    os.utime(BUILT / "package.json")


def data_files() -> list[tuple[str, list[str]]]:
    """The built extension's files, as (install folder, [files]) pairs."""
    if not (BUILT / "package.json").exists():
        return []
    groups: dict[str, list[str]] = {}
    for path in sorted(BUILT.rglob("*")):
        if path.is_file():
            folder = path.parent.relative_to(BUILT).as_posix()
            target = SHARE if folder == "." else f"{SHARE}/{folder}"
            groups.setdefault(target, []).append(path.relative_to(HERE).as_posix())
    return sorted(groups.items())


def packages() -> list[str]:
    """Every package of the source tree: monarch_kernel's own folders, and magics/ (installed as
    monarch_kernel.magics, see package-dir in pyproject.toml) with any folders it grows."""
    found = find_packages(where=str(HERE), include=["monarch_kernel", "monarch_kernel.*"])
    magics = ["monarch_kernel.magics" + name.removeprefix("magics")
              for name in find_packages(where=str(HERE), include=["magics", "magics.*"])]
    return sorted(found + magics)


build_labextension()
setup(packages=packages(), data_files=data_files())
