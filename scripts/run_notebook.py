"""Execute a notebook headless with a real kernel and save it with its outputs.

usage: python scripts/run_notebook.py NOTEBOOK [OUTPUT] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import nbformat
from nbclient import NotebookClient


def show(nb) -> None:
    """Print code cells and their text outputs, as a reader would see them."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        print("\n".join(f"In  | {line}" for line in cell.source.splitlines()))
        for out in cell.outputs:
            if out.output_type == "stream":
                text = out.text
            elif out.output_type == "error":
                text = f"{out.ename}: {out.evalue}"
            else:
                text = out.get("data", {}).get("text/plain", "")
            for line in text.rstrip("\n").splitlines():
                print(f"Out | {line}")
        print()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebook")
    parser.add_argument("output", nargs="?")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--show", action="store_true", help="print each cell's text output")
    args = parser.parse_args()
    out = args.output or args.notebook.replace(".ipynb", ".executed.ipynb")
    nb = nbformat.read(args.notebook, as_version=4)
    start = time.monotonic()
    client = NotebookClient(nb, timeout=args.timeout, kernel_name=args.kernel,
                            resources={"metadata": {"path": os.path.dirname(os.path.abspath(args.notebook))}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, out)
    if args.show:
        show(nb)
    print(f"executed {args.notebook} in {time.monotonic() - start:.1f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
