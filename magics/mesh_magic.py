"""`%mesh` and `%%mesh`: thin shells over the monarch_kernel Python API."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from monarch_kernel.api.mesh import Mesh
from monarch_kernel.api.ray import ray_mesh
from monarch_kernel.api.slurm import slurm_mesh
from monarch_kernel.api.starting import local_mesh, ssh_mesh
from monarch_kernel.core.errors import CellSyntaxError, MeshError, RemoteError
from monarch_kernel.core.ranksets import format_ranks
from monarch_kernel.core.shape import parse_spec
from monarch_kernel.core.shell_syntax import to_mesh_python
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.views.display import show_mesh, show_run_timing
from monarch_kernel.views.shardview import visualize_sharding

from . import persist_commands
from .commands import HELP, USAGE, cell_parser, line_parser
from .debugger import MeshDebugger
from .registry import MeshRegistry


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def _parse_resources(pairs: list[str]) -> dict[str, float]:
    """`--resource K=V` pairs as Ray's resources per rank (V a number; memory in bytes)."""
    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            found[key] = float(value)
        except ValueError:
            raise UsageError(f"--resource {pair!r}: expected NAME=NUMBER (CPU=8, memory=34359738368)") from None
        if not sep or not key:
            raise UsageError(f"--resource {pair!r}: expected NAME=NUMBER")
    return found


@magics_class
class MeshMagics(Magics):
    """The %mesh line magic and %%mesh cell magic."""

    shell: Any  # IPython's InteractiveShell (never None once registered)

    def __init__(self, shell, registry: MeshRegistry):
        super().__init__(shell)
        self.registry = registry
        self._line = line_parser()
        self._cell = cell_parser()
        self._parsed: dict[str, argparse.Namespace] = {}  # %%mesh lines already parsed (read only)
        self._auto: str | None = None  # "%mesh on": the mesh every cell goes to
        self.timing = True  # per-rank timing bars after each %%mesh cell
        self.debugger: MeshDebugger | None = None  # JupyterLab's debugger, for the ranks (in a kernel that has one)

    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        """Run cells on a mesh of ranks, and manage meshes.

        %mesh up local --gpus 4 --dist gloo     start 4 local ranks
        %mesh up ssh gpu-a gpu-b --gpus 8       8 ranks on each of two SSH hosts
        %%mesh                                  run this cell on every rank
        %%mesh --gpus 0:2 --timeout 30          ... on a slice, with a timeout
        %mesh status | use | down | restart | interrupt | push | pull | logs | on | off
        %mesh sharding x                        how DTensor x lies on the mesh
        %mesh plan build batch --loss F         which layouts fit, which is fastest (--trial, --apply)
        %mesh run train.py --epochs 3           a torchrun script on every rank
        """
        words = line.split()
        asks_help = bool({"-h", "--help"} & set(words[:2] if words[:1] == ["run"] else words))  # a script's own --help
        if asks_help or words[:1] == ["help"]:
            print(HELP)  # asked for help: not an error, and the cell does not run
            return None
        try:
            if cell is None:
                return self._line_magic(line)
            return self._cell_magic(line, cell)
        except (RemoteError, CellSyntaxError):
            raise  # IPython shows these through their _render_traceback_
        except MeshError as exc:
            raise UsageError(str(exc)) from None

    # ------------------------------------------------------------ %%mesh
    def _cell_magic(self, line: str, cell: str) -> Any:
        args = self._cell_options(line)
        target = self._target(args)
        count = prompt_number(self.shell)
        name = f"In[{count}]" if count is not None else None
        if args.profile is not None:
            if args.bg:
                raise UsageError("--profile and --bg do not go together: a profile ends with its cell")
            return target.profiled(lambda: self._cell_magic_run(target, args, cell, name), args.profile,
                                   name or "cell")
        return self._cell_magic_run(target, args, cell, name)

    def _cell_magic_run(self, target: Mesh, args: argparse.Namespace, cell: str, name: str | None) -> Any:
        code, filename = _ipython_to_python(cell), None
        if self.debugger is not None:  # JupyterLab's debugger is on: the chosen rank stops at the cell's breakpoints
            filename = self.debugger.prepare(target)
            if filename is not None:
                code = self.debugger.cell_code(code)
        try:
            future = target.run_async(code, timeout=args.timeout, fail_fast=args.fail_fast,
                                      dedupe=not args.no_dedupe, name=name, background=args.bg, filename=filename)
        except SyntaxError as exc:
            raise CellSyntaxError(exc) from None  # shown like a local SyntaxError
        if args.bg:
            return future
        try:
            result = future.get()
        finally:
            self._show_timing(target, future)
        return result if _has_values(result) else None

    def _cell_options(self, line: str) -> argparse.Namespace:
        """The options of a %%mesh line, parsed once per distinct line (most cells repeat theirs)."""
        args = self._parsed.get(line)
        if args is None:
            args = self._cell.parse_args(shlex.split(line))
            if len(self._parsed) >= 64:
                self._parsed.clear()
            self._parsed[line] = args
        return args

    def _show_timing(self, target: Mesh, future: Any) -> None:
        if self.timing and future.done():
            show_run_timing(future.label, future.rank_times(), [target])

    def _target(self, args: argparse.Namespace) -> Mesh:
        mesh = self.registry.get(args.name)
        if args.ranks is not None:
            if args.hosts is not None or args.gpus is not None:
                raise UsageError("--ranks cannot be combined with --hosts/--gpus")
            return mesh.select_ranks(_spec_ranks(args.ranks, mesh))
        selectors = {}
        for dim in ("hosts", "gpus"):
            value = getattr(args, dim)
            if value is not None:
                selectors[dim] = _keep_dim(parse_spec(value))
        return mesh.slice(**selectors) if selectors else mesh

    # ------------------------------------------------------------ %mesh
    def _line_magic(self, line: str) -> Any:
        words = shlex.split(line)
        if not words:
            raise UsageError(USAGE)
        args = self._line.parse_args(words)
        handler = getattr(self, f"_do_{args.command}")
        return handler(args)

    def _do_up(self, args) -> None:
        name, env = args.name or self._fresh_name(), _parse_env(args.env)
        if args.kind == "local":
            if args.hosts:
                raise UsageError(f"%mesh up local takes no hosts (got {' '.join(args.hosts)}); did you mean ssh?")
            mesh = local_mesh(args.gpus, dist=args.dist or "gloo", name=name, env=env, timeout=args.timeout or 120.0,
                              preload=args.preload, persist=args.persist)
        elif args.kind == "slurm":
            if args.hosts:
                raise UsageError(f"%mesh up slurm takes no hosts (got {' '.join(args.hosts)}): Slurm chooses "
                                 "the nodes; use --nodes N (or --job ID for an allocation you have)")
            mesh = slurm_mesh(args.nodes or 1, args.gpus or 1, partition=args.partition, time=args.time,
                              account=args.account, qos=args.qos, constraint=args.constraint,
                              sbatch_args=args.sbatch_arg, request_gpus=not args.no_gpu_request, job=args.job,
                              reuse=args.reuse,
                              python=None if args.python == "python3" else args.python, setup=args.setup,
                              dist=args.dist or "nccl", env=env, name=args.name if args.reuse else name,
                              keep=args.keep,
                              wait_timeout=args.wait_timeout, timeout=args.timeout or 180.0,
                              master_addr=args.master_addr, direct=not args.no_direct, preload=args.preload,
                              persist=args.persist)
        elif args.kind == "ray":
            if args.hosts:
                raise UsageError(f"%mesh up ray takes no host names (got {' '.join(args.hosts)}): Ray places the "
                                 "ranks; use --hosts N for the number of nodes")
            mesh = ray_mesh(args.address, args.ray_hosts or 1, args.gpus or 1, strategy=args.strategy,
                            request_gpus=not args.no_gpu_request, resources=_parse_resources(args.resource),
                            python=None if args.python == "python3" else args.python, dist=args.dist or "nccl",
                            env=env, name=name, wait_timeout=args.wait_timeout, timeout=args.timeout or 180.0,
                            master_addr=args.master_addr, preload=args.preload, persist=args.persist)
        else:
            if not args.hosts or args.gpus is None:
                raise UsageError("%mesh up ssh HOST [HOST ...] --gpus N: give the hosts and ranks per host")
            mesh = ssh_mesh(args.hosts, args.gpus, dist=args.dist or "nccl", python=args.python, setup=args.setup,
                            env=env, name=name, connect_timeout=args.connect_timeout,
                            master_addr=args.master_addr, ship_package=args.ship, timeout=args.timeout or 180.0,
                            preload=args.preload, persist=args.persist)
        self.registry.add(mesh)
        self._show_status(mesh)

    _do_attach = persist_commands.do_attach

    def _fresh_name(self) -> str:
        i = 0
        while f"mesh{i}" in self.registry.names():
            i += 1
        return f"mesh{i}"

    def _do_status(self, args) -> None:
        self._show_status(self.registry.get(args.name))

    def _show_status(self, mesh: Mesh) -> None:
        show_mesh(mesh, default=mesh.name == self.registry.current)
        if mesh.allocation is not None:
            print(mesh.allocation)

    def _do_use(self, args) -> None:
        self.registry.use(args.name)
        print(f"default mesh is now {args.name!r}")

    def _do_down(self, args) -> None:
        mesh = self.registry.get(args.name)
        mesh.shutdown()
        self.registry.remove(mesh.name)
        if self._auto == mesh.name:
            self._set_auto(None)
        print(f"mesh {mesh.name!r} is down")

    def _do_restart(self, args) -> None:
        mesh = self.registry.get(args.name)
        mesh.restart()
        self._show_status(mesh)

    def _do_interrupt(self, args) -> None:
        self.registry.get(args.name).interrupt()

    def _do_push(self, args) -> None:
        mesh = self.registry.get(args.mesh)
        ns = self.shell.user_ns
        missing = [v for v in args.vars if v not in ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        mesh.push(**{v: ns[v] for v in args.vars})

    def _do_pull(self, args) -> ValueMesh:
        expr = " ".join(args.expr).strip()
        if not expr:
            raise UsageError("%mesh pull EXPR: give an expression, e.g. %mesh pull loss")
        return self.registry.get().pull(expr)

    def _do_run(self, args) -> None:
        self.registry.get(args.mesh).run_script(args.script, args.argv, timeout=args.timeout, fail_fast=args.fail_fast)

    def _do_sync(self, args) -> None:
        self.registry.get(args.mesh).sync_workspace(args.path, exclude=args.exclude, auto=args.auto, chdir=args.cd,
                                                    force=args.force)

    def _do_put(self, args) -> None:
        self.registry.get(args.mesh).put(args.src, args.dst)

    def _do_get(self, args) -> None:
        self.registry.get(args.mesh).get(args.src, args.dst)

    def _do_env(self, args) -> None:
        print(self.registry.get(args.mesh).environment().text())

    def _do_autoreload(self, args) -> None:
        self.registry.get(args.mesh).autoreload(args.setting == "on")
        print(f"autoreload of synced modules on the ranks: {args.setting}")

    def _do_config(self, args) -> None:
        if args.setting == "hang":
            mesh = self.registry.get(args.mesh)
            try:
                mesh.hang_after_s = None if args.value == "off" else float(args.value)
            except ValueError:
                raise UsageError(f"%mesh config hang {args.value}: give a number of seconds, or off") from None
            print(f"a cell on {mesh.name!r} whose ranks make no progress for {args.value} s shows why"
                  if args.value != "off" else f"cells on {mesh.name!r} no longer say why they hang")
            return
        if args.value not in ("on", "off"):
            raise UsageError(f"%mesh config timing {args.value}: on or off")
        self.timing = args.value == "on"
        print(f"per-rank timing after each %%mesh cell: {args.value}")

    def _do_why(self, args) -> Any:
        return self.registry.get(args.name).why()

    def _do_profile(self, args) -> Any:
        mesh = self.registry.get(args.name)
        if args.ranks is not None:
            mesh = mesh.select_ranks(_spec_ranks(args.ranks, mesh))
        return mesh.sample_stacks(args.seconds)

    def _do_stacks(self, args) -> Any:
        mesh = self.registry.get(args.name)
        if args.ranks is not None:
            mesh = mesh.select_ranks(_spec_ranks(args.ranks, mesh))
        if args.native:
            return mesh.native_stacks()
        return mesh.stacks(all_threads=args.all_threads)

    def _do_sharding(self, args) -> Any:
        return visualize_sharding(self.registry.get(args.mesh), args.expr, rows=args.rows, cols=args.cols)

    def _do_plan(self, args) -> Any:
        namespace = self.shell.user_ns
        missing = [n for n in (args.build, args.batch, args.loss) if n not in namespace]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)} (define build(), batch() and the loss)")
        plan = self.registry.get(args.mesh).plan(namespace[args.build], namespace[args.batch], loss=namespace[args.loss],
                                                 memory=args.memory, optimizer=args.optimizer, lr=args.lr,
                                                 strategies=tuple(s for s in args.strategies.split(",") if s),
                                                 precision=args.precision)
        if args.trial:
            plan.trial()
        if args.apply:
            plan.apply()
        return plan

    def _do_logs(self, args) -> None:
        mesh = self.registry.get(args.mesh)
        if args.host is not None:
            host = int(args.host) if args.host.isdigit() else args.host
            print(f"--- agent on host {args.host} (last {args.lines} lines)")
            print(mesh.agent_log(host, args.lines) or "(empty)")
            if args.rank is None:
                return
        ranks = [args.rank] if args.rank is not None else list(mesh.ranks)
        for rank in ranks:
            print(f"--- rank {rank} (last {args.lines} lines)")
            for stream, text in mesh.logs(rank, args.lines):
                print(("! " if stream == "stderr" else "  ") + text)

    def _do_debug(self, args) -> None:
        """Choose the rank JupyterLab's debugger stops in (`rank N`, `off`); with neither, post-mortem
        pdb on the ranks whose last cell failed (like %debug), in the notebook."""
        if args.what is not None:
            self._choose_debugged_rank(args)
            return
        mesh = self.registry.get(args.mesh)
        target = mesh.select_ranks(_spec_ranks(args.ranks, mesh)) if args.ranks else mesh
        if not target.debug():
            print(f"no rank of mesh {mesh.name!r} has a failed cell to debug")

    def _choose_debugged_rank(self, args) -> None:
        if self.debugger is None:
            raise UsageError("this kernel has no debugger (JupyterLab's needs ipykernel 6+ with debugpy installed)")
        if args.what == "post-mortem":
            self._post_mortem_in_debugger(args)
            return
        if args.what == "off":
            self.debugger.chosen_mesh, self.debugger.chosen_rank = None, 0
            self.debugger.detach()
            print("JupyterLab's debugger stops in rank 0 of each cell's mesh again")
            return
        if args.rank is None:
            raise UsageError("say which rank: %mesh debug rank 2")
        try:
            print(self.debugger.choose(self.registry.get(args.mesh), args.rank))
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def _post_mortem_in_debugger(self, args) -> None:
        assert self.debugger is not None
        if not self.debugger.is_on:
            raise UsageError("turn on JupyterLab's debugger first (the bug icon in the notebook's toolbar); "
                             "%mesh debug alone opens pdb in the notebook instead")
        mesh = self.registry.get(args.mesh)
        failed = mesh.failed_ranks()
        if not failed:
            print(f"no rank of mesh {mesh.name!r} has a failed cell to debug")
            return
        if args.rank is not None and args.rank not in failed:
            raise UsageError(f"rank {args.rank}'s last cell did not fail; these did: {format_ranks(failed)}")
        rank = failed[0] if args.rank is None else args.rank
        self.debugger.chosen_mesh, self.debugger.chosen_rank = mesh.name, rank
        self.debugger.prepare(mesh)
        print(f"rank {rank} of mesh {mesh.name!r} stopped at its error in JupyterLab's debugger; continue there "
              "(or press stop) to end this cell", flush=True)
        mesh.select_ranks([rank]).debug_in_debugger()

    def _do_on(self, args) -> None:
        mesh = self.registry.get(args.mesh)
        self._set_auto(mesh.name)
        print(f"every cell now runs on mesh {mesh.name!r} until %mesh off")

    def _do_off(self, args) -> None:
        self._set_auto(None)
        print("cells run locally again")

    def _set_auto(self, name: str | None) -> None:
        transformers = self.shell.input_transformers_cleanup
        if self._route_cell in transformers:
            transformers.remove(self._route_cell)
        self._auto = name
        if name is not None:
            transformers.append(self._route_cell)

    def _route_cell(self, lines: list[str]) -> list[str]:
        """Input transformer for `%mesh on`: prefix cells with %%mesh."""
        first = next((ln for ln in lines if ln.strip()), "")
        if not first or first.lstrip().startswith(("%mesh", "%%mesh", "%load_ext", "%unload_ext")):
            return lines
        return [f"%%mesh --name {self._auto}\n", *lines]


def _spec_ranks(text: str, mesh: Mesh) -> list[int]:
    """The global ranks a --ranks SPEC picks out of a mesh."""
    spec = parse_spec(text)
    ranks = [spec] if isinstance(spec, int) else (list(mesh.ranks)[spec] if isinstance(spec, slice) else spec)
    if not ranks:
        raise UsageError(f"--ranks {text} selects no rank of {format_ranks(mesh.ranks)}")
    return ranks


# where IPython syntax can be: !cmd and %magic lines, `x = !cmd`, `obj?`, pasted >>> prompts
_MAYBE_IPYTHON = re.compile(r"^\s*(?:[!%]|>>>)|=\s*[!%]|\?\s*$", re.MULTILINE)


def _ipython_to_python(cell: str) -> str:
    """A cell's IPython syntax (`!cmd`, `x = !cmd`, `%magic`) as calls on the ranks' shell.

    A fresh transformer manager: the shell's own would route the body to the mesh again
    while `%mesh on` is active.
    """
    if not _MAYBE_IPYTHON.search(cell):
        return cell  # plain Python (most cells): no need to tokenize it
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        python = TransformerManager().transform_cell(cell)
    except Exception:  # noqa: BLE001 - leave it to the syntax check to explain
        return cell
    return cell if python.rstrip("\n") == cell.rstrip("\n") else to_mesh_python(python)


def _keep_dim(spec):
    """Magic selectors keep the dim even for an int, so coordinates stay readable."""
    return [spec] if isinstance(spec, int) else spec


def _has_values(result: Any) -> bool:
    return isinstance(result, ValueMesh) and any(v is not None for v in result.values())


def prompt_number(shell: Any) -> int | None:
    """The prompt number of the cell running now, as the notebook shows it (`[4]` -> 4).

    IPython's own `displayhook.prompt_count` is what it labels `Out[4]` with: IPython 9 counts
    `execution_count` up before a cell runs (so the running cell is `execution_count - 1`),
    IPython 8 after; the display hook knows which.
    """
    count = getattr(getattr(shell, "displayhook", None), "prompt_count", None)
    if isinstance(count, int):
        return count
    count = getattr(shell, "execution_count", None)
    return count if isinstance(count, int) else None
