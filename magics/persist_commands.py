"""`%mesh attach`: list the persistent meshes, or take one back after a kernel restart."""

from __future__ import annotations

import argparse
from typing import Any

from monarch_kernel.api.persistent import attach, persistent_meshes


def do_attach(magic: Any, args: argparse.Namespace) -> None:
    """`%mesh attach` lists; `%mesh attach NAME [--take]` attaches (the MeshMagics method)."""
    if args.name is None:
        found = persistent_meshes()
        for listed in found:
            print(listed.line())
        if not found:
            print("no persistent meshes: start one with %mesh up local --persist 8h --name NAME")
        return
    mesh = attach(args.name, take=args.take)
    registry = magic.registry
    if args.name in registry.names():  # this kernel held it before (taken over since): the new handle replaces it
        registry.remove(args.name)
    registry.add(mesh)
    magic._show_status(mesh)
