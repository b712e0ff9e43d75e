"""The `%mesh` subcommands and `%%mesh` options, in one table: parsers, usage and help come from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, NoReturn

from IPython.core.error import UsageError

from monarch_kernel.api.mesh_start import BACKENDS


@dataclass(frozen=True)
class Arg:
    """One argument of a subcommand: argparse's flags and keywords."""

    flags: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


def arg(*flags: str, **options: Any) -> Arg:
    """An argument, written as for argparse's add_argument."""
    return Arg(flags, options)


@dataclass(frozen=True)
class Subcommand:
    """`%mesh NAME ...`: its arguments as typed, what it does, and its argparse arguments."""

    name: str
    synopsis: str
    summary: str
    args: tuple[Arg, ...] = ()


_MESH_NAME = arg("--name", dest="mesh", default=None)

SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("up", "local [--gpus N] [--name NAME] [--dist gloo|nccl|none] [--env K=V ...] [--preload M,M]\n"
               "             [--persist DURATION]\n"
               "%mesh up ssh HOST [HOST ...] --gpus N [--dist ...] [--python P] [--setup CMD] [--master-addr A]\n"
               "             [--connect-timeout S] [--ship] [--name NAME] [--env K=V ...]\n"
               "%mesh up slurm --nodes N --gpus G [--partition P] [--time T] [--account A] [--qos Q]\n"
               "             [--constraint C] [--sbatch-arg ARG ...] [--no-gpu-request] [--job ID | --reuse] [--keep]\n"
               "             [--wait-timeout S] [--python P] [--setup CMD] [--dist ...] [--name NAME] [--no-direct]\n"
               "%mesh up ray [--address auto|ray://HEAD:10001|HEAD:6379] --hosts N --gpus G [--pack|--spread|\n"
               "             --strategy S] [--resource K=V ...] [--no-gpu-request] [--wait-timeout S] [--python P]",
               "start a mesh on this machine, on SSH hosts, in a Slurm allocation or on a Ray cluster (the newest is "
               "the default)", (
                   arg("kind", choices=["local", "ssh", "slurm", "ray"], help="where ranks run"),
                   arg("hosts", nargs="*", help="SSH hosts (ssh only)"),
                   arg("--gpus", type=int, default=None),
                   arg("--name", default=None),
                   arg("--dist", choices=BACKENDS, default=None),
                   arg("--env", nargs="*", default=[], metavar="K=V"),
                   arg("--preload", default=None, metavar="MODULE,MODULE",
                       help="modules each host imports once before forking ranks (default: torch, "
                            "unless --dist none; '' for none)"),
                   arg("--timeout", type=float, default=None),
                   arg("--persist", default=None, metavar="DURATION",
                       help="local: the mesh outlives the kernel this long without one (8h, 30m, 90s); "
                            "%%mesh attach NAME takes it back"),
                   arg("--python", default="python3"),
                   arg("--setup", default=None),
                   arg("--master-addr", default=None),
                   arg("--connect-timeout", type=float, default=30.0),
                   arg("--ship", action="store_true", help="copy this package's source to the hosts"),
                   arg("--nodes", type=int, default=None), arg("--partition", default=None),
                   arg("--time", default=None), arg("--account", default=None), arg("--qos", default=None),
                   arg("--constraint", default=None), arg("--sbatch-arg", action="append", default=[]),
                   arg("--no-gpu-request", action="store_true", help="CPU nodes: ask Slurm for no GPUs"),
                   arg("--job", default=None, help="attach to this running allocation"),
                   arg("--reuse", action="store_true", help="attach to your newest running mesh job"),
                   arg("--keep", action="store_true", help="leave the allocation running at down"),
                   arg("--wait-timeout", type=float, default=None),
                   arg("--address", default=None, help="Ray: the cluster (default: auto)"),
                   arg("--hosts", dest="ray_hosts", type=int, default=None, help="Ray: nodes"),
                   arg("--pack", dest="strategy", action="store_const", const="PACK",
                       help="Ray: pack the ranks' bundles on few nodes (the default; one host: strictly)"),
                   arg("--spread", dest="strategy", action="store_const", const="SPREAD",
                       help="Ray: spread them over nodes"),
                   arg("--strategy", dest="strategy", default=None, help="Ray: any placement strategy of Ray's"),
                   arg("--resource", action="append", default=[], metavar="K=V",
                       help="Ray: a resource per rank besides GPUs (CPU=8, memory=..., custom)"),
                   arg("--no-direct", action="store_true",
                       help="Slurm: keep all traffic on srun's stdio (no direct TCP link to the nodes)"))),
    Subcommand("attach", "[NAME] [--take]",
               "take back a persistent mesh (ranks, variables, actors) after a kernel restart; no NAME: list them",
               (arg("name", nargs="?"), arg("--take", action="store_true",
                                            help="even if another live kernel holds it (that kernel loses it)"))),
    Subcommand("status", "[NAME]", "each rank's host, pid, state and load", (arg("name", nargs="?"),)),
    Subcommand("use", "NAME", "make NAME the default mesh", (arg("name"),)),
    Subcommand("down", "[NAME]", "stop a mesh: every rank and agent ends", (arg("name", nargs="?"),)),
    Subcommand("restart", "[NAME]", "replace the ranks with fresh ones (same shape)", (arg("name", nargs="?"),)),
    Subcommand("interrupt", "[NAME]", "KeyboardInterrupt on whatever the ranks run", (arg("name", nargs="?"),)),
    Subcommand("push", "VAR [VAR ...] [--name NAME]", "copy notebook variables to every rank",
               (arg("vars", nargs="+"), _MESH_NAME)),
    Subcommand("pull", "EXPR", "evaluate EXPR on every rank and bring the values back",
               (arg("expr", nargs=argparse.REMAINDER),)),
    Subcommand("run", "[--timeout S] [--fail-fast] [--name NAME] SCRIPT [ARGS ...]",
               "run a script on every rank as torchrun would (__main__, sys.argv)", (
                   arg("--timeout", type=float, default=None), arg("--fail-fast", action="store_true"), _MESH_NAME,
                   arg("script"), arg("argv", nargs=argparse.REMAINDER))),
    Subcommand("sync", "[PATH] [--exclude PATTERN ...] [--auto] [--cd] [--force] [--name NAME]",
               "copy a folder (default: this project) to every host and put it on the ranks' sys.path", (
                   arg("path", nargs="?", default=None), arg("--exclude", action="append", default=[]),
                   arg("--auto", action="store_true", help="send changes before each mesh cell"),
                   arg("--cd", action="store_true", help="make it the ranks' working folder"),
                   arg("--force", action="store_true", help="sync even past the size guard"), _MESH_NAME)),
    Subcommand("put", "SRC DST [--name NAME]", "copy a local file or folder to path DST on every host",
               (arg("src"), arg("dst"), _MESH_NAME)),
    Subcommand("get", "SRC [DST_DIR] [--name NAME]",
               "bring path SRC from every host (or every rank: {rank} in SRC) into a local folder",
               (arg("src"), arg("dst", nargs="?", default="."), _MESH_NAME)),
    Subcommand("env", "[--name NAME]", "Python and package versions of every host next to the notebook's",
               (_MESH_NAME,)),
    Subcommand("autoreload", "on|off [--name NAME]",
               "reload changed modules of synced folders on the ranks before each cell",
               (arg("setting", choices=["on", "off"]), _MESH_NAME)),
    Subcommand("logs", "[HOST] [--rank R] [--lines N] [--name NAME]", "what ranks (or a host agent) printed lately", (
        arg("host", nargs="?", default=None, help="show this host agent's log"),
        arg("--rank", type=int, default=None), arg("--lines", type=int, default=30), _MESH_NAME)),
    Subcommand("debug", "[rank R | post-mortem [R] | off] [--ranks SPEC] [--name NAME]",
               "rank R: JupyterLab's debugger stops in rank R at %%mesh cells' breakpoints (off: rank 0 of each\n"
               "             cell's mesh again); post-mortem: the error of the last failed cell in JupyterLab's debugger\n"
               "             (on rank R, or the first that failed); alone: pdb at that error, in the notebook",
               (arg("what", nargs="?", choices=["rank", "post-mortem", "off"], default=None),
                arg("rank", nargs="?", type=int),
                _MESH_NAME, arg("--ranks", default=None))),
    Subcommand("sharding", "EXPR [--rows DIM] [--cols DIM] [--name NAME]", "how a DTensor (or module) lies on the mesh",
               (arg("expr"), arg("--rows", type=int, default=None), arg("--cols", type=int, default=None), _MESH_NAME)),
    Subcommand("plan", "BUILD BATCH --loss F [--memory 20GiB|auto] [--strategies ddp,fsdp,tp,pp[,ac]] [--optimizer adamw]\n"
               "             [--lr LR] [--precision fp32|bf16] [--trial] [--apply] [--name NAME]",
               "which layouts (DDP, FSDP, TP, FSDP x TP) of a model fit the mesh, and which is fastest",
               (arg("build"), arg("batch"), arg("--loss", required=True), arg("--memory", default="auto"),
                arg("--strategies", default="ddp,fsdp,tp,pp"), arg("--optimizer", default="adamw"),
                arg("--lr", type=float, default=None), arg("--precision", default="fp32"),
                arg("--trial", action="store_true"),
                arg("--apply", action="store_true"), _MESH_NAME)),
    Subcommand("why", "[NAME]", "why the ranks are where they are: who waits in which collective for whom",
               (arg("name", nargs="?"),)),
    Subcommand("stacks", "[NAME] [--ranks SPEC] [--all-threads] [--native]",
               "every rank's Python stack now, grouped across ranks (--native: py-spy's native stacks)", (
                   arg("name", nargs="?"), arg("--ranks", default=None), arg("--all-threads", action="store_true"),
                   arg("--native", action="store_true"))),
    Subcommand("profile", "[NAME] [--seconds S] [--ranks SPEC]",
               "where the time goes on a running mesh: its ranks' Python stacks sampled, as a flame table", (
                   arg("name", nargs="?"), arg("--seconds", type=float, default=5.0), arg("--ranks", default=None))),
    Subcommand("config", "timing on|off | hang SECONDS|off [--name NAME]",
               "per-rank timing bars after each %%mesh cell; after how long a cell without progress shows why",
               (arg("setting", choices=["timing", "hang"]), arg("value"), _MESH_NAME)),
    Subcommand("on", "[--name NAME]", "send every following cell to the mesh", (_MESH_NAME,)),
    Subcommand("off", "", "cells run locally again"),
)

CELL_OPTIONS: tuple[Arg, ...] = (
    arg("--name", default=None), arg("--hosts", default=None), arg("--gpus", default=None),
    arg("--ranks", default=None), arg("--timeout", type=float, default=None),
    arg("--fail-fast", action="store_true"), arg("--no-dedupe", action="store_true"), arg("--bg", action="store_true"),
    arg("--profile", nargs="?", const="mesh-profiles", default=None, metavar="DIR"),
)
CELL_SYNOPSIS = ("%%mesh [--name NAME] [--hosts SPEC] [--gpus SPEC] [--ranks SPEC] [--timeout S]\n"
                 "       [--fail-fast] [--no-dedupe] [--bg] [--profile [DIR]]")

USAGE = "\n".join([*(f"%mesh {c.name} {c.synopsis}".rstrip() for c in SUBCOMMANDS), CELL_SYNOPSIS,
                   "SPEC is an int (2), a list (0,2) or a slice (0:4, ::2)."])

HELP = "\n".join([
    "%mesh / %%mesh: run notebook cells on a mesh of worker processes (ranks), one per GPU.", "",
    *(f"  {c.name:<10} {c.summary}" for c in SUBCOMMANDS), "",
    USAGE, "",
    "In %%mesh cells, !cmd, out = !cmd and %pip, %env, %cd, %pwd, %time, %%time, %%bash,",
    "%%sh, %%writefile run on every rank's host. The same from Python: local_mesh(),",
    "ssh_mesh(), mesh.run / push / pull / spawn (see the README)."])


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, no traceback) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise UsageError instead of exiting."""
        raise UsageError(f"{message}\nusage:\n{USAGE}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        """Raise UsageError instead of exiting (e.g. after --help)."""
        raise UsageError(message or USAGE)


def line_parser() -> Parser:
    """The parser of `%mesh SUBCOMMAND ...`, built from SUBCOMMANDS."""
    parser = Parser(prog="%mesh", add_help=False)
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for command in SUBCOMMANDS:
        p = sub.add_parser(command.name, add_help=False, help=command.summary)
        for a in command.args:
            p.add_argument(*a.flags, **a.options)
    return parser


def cell_parser() -> Parser:
    """The parser of the `%%mesh` line, built from CELL_OPTIONS."""
    parser = Parser(prog="%%mesh", add_help=False)
    for a in CELL_OPTIONS:
        parser.add_argument(*a.flags, **a.options)
    return parser
