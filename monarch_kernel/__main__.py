"""`python -m monarch_kernel install`: register the "Python 3 (monarch)" kernelspec."""

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
    args = parser.parse_args(argv)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix, python=sys.executable)
    print(f'installed kernelspec "{DISPLAY_NAME}" ({KERNEL_NAME}) in {path}')


if __name__ == "__main__":
    main()
