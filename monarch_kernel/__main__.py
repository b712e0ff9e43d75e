"""`python -m monarch_kernel install`: register the "Python 3 (monarch)" kernelspec.
`python -m monarch_kernel meshes [stop NAME]`: list this user's persistent meshes, or stop one."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

KERNEL_NAME = "monarch"
DISPLAY_NAME = "Python 3 (monarch)"


def kernel_json(python: str) -> dict:
    """The kernelspec: ipykernel with the monarch_kernel extension loaded at start."""
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=monarch_kernel"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "metadata": {"debugger": True},
    }


def install(*, user: bool, prefix: str | None, python: str) -> str:
    """Install the kernelspec; returns where it went."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "kernel.json"), "w") as f:
            json.dump(kernel_json(python), f, indent=2)
        return KernelSpecManager().install_kernel_spec(tmp, KERNEL_NAME, user=user, prefix=prefix)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m monarch_kernel")
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help=f'register the "{DISPLAY_NAME}" Jupyter kernel')
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user only")
    where.add_argument("--sys-prefix", action="store_true", help="install into sys.prefix (e.g. a venv)")
    inst.add_argument("--prefix", default=None, help="install under this prefix")
    meshes = sub.add_parser("meshes", help="list your persistent meshes on this machine (or stop one)")
    meshes.add_argument("action", nargs="?", choices=["stop"], help="stop the mesh NAME now")
    meshes.add_argument("name", nargs="?", help="the mesh to stop")
    args = parser.parse_args(argv)
    if args.command == "meshes":
        sys.exit(list_or_stop(args.action, args.name))
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix, python=sys.executable)
    print(f'installed kernelspec "{DISPLAY_NAME}" ({KERNEL_NAME}) in {path}')


def list_or_stop(action: str | None, name: str | None) -> int:
    """`meshes`: one line per persistent mesh; `meshes stop NAME`: stop it. The exit status."""
    from monarch_kernel.api.persistent import persistent_meshes, stop_persistent
    from monarch_kernel.core.errors import MeshUsageError
    from monarch_kernel.core.mesh_records import RecordError

    if action == "stop":
        if not name:
            print("python -m monarch_kernel meshes stop NAME: name the mesh to stop", file=sys.stderr)
            return 2
        try:
            print(stop_persistent(name))
        except (RecordError, MeshUsageError) as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    found = persistent_meshes()
    for mesh in found:
        print(mesh.line())
    if not found:
        print("no persistent meshes (start one with %mesh up local --persist 8h, or local_mesh(persist='8h'))")
    return 0


if __name__ == "__main__":
    main()
