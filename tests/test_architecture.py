"""The layout's rules: which folder may import which, no import cycles, light ranks and agents.

Each folder of monarch_kernel/ holds the code of one process (or of every process, for
core/ and wire/). docs/architecture.md ("Package layout") states the same rules.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import monarch_kernel

PKG = Path(monarch_kernel.__file__).parent
MAGICS = Path(__file__).parent.parent / "magics"

# folder -> folders it may import (itself included implicitly)
RULES = {
    "core": set(),
    "wire": {"core"},
    "actors": {"core", "wire"},
    # a rank applies a plan's layout (planner/, pure torch) when the notebook asks (wire/ops.ApplyLayout)
    "rank": {"core", "wire", "actors", "planner"},
    "agent": {"core", "wire", "rank"},
    "controller": {"core", "wire"},
    # the planner: pure torch, in the notebook (estimates, in helper processes) and on ranks (apply)
    "planner": {"core"},
    "api": {"core", "wire", "actors", "controller", "planner"},
    "views": {"core", "api", "planner"},
    "magics": {"core", "actors", "api", "views"},
    # Monarch's API for programs, in the notebook and on ranks: its notebook-only parts (starting
    # processes) import api/ inside functions that ranks never call (checked on real ranks below)
    "monarch": {"core", "wire", "actors", "api"},
}
# single imports across the rules, each with its reason
CROSSINGS = {
    # the Ray actor class the controller asks Ray to place in each bundle: its code runs on the node
    # (next to the agent it starts), the controller only names it
    ("monarch_kernel.controller.ray_cluster", "monarch_kernel.agent.ray_slot"),
    # Monarch's run_worker_loop_forever makes the process that calls it a host's worker (agent/worker.py):
    # neither the notebook nor a rank, it starts host agents
    ("monarch_kernel.monarch.actor", "monarch_kernel.agent.worker"),
}
ROOT_MODULES = {"monarch_kernel", "monarch_kernel.__main__"}  # the lazy re-exports and the CLI
NOTEBOOK_ONLY = ("monarch_kernel.controller", "monarch_kernel.api", "monarch_kernel.views", "monarch_kernel.magics")
HEAVY = ("IPython", "rich", "ipywidgets", "asyncssh")


def module_files() -> dict[str, Path]:
    """Every module of the package (magics as installed: monarch_kernel.magics)."""
    found = {}
    for base, prefix in ((PKG, "monarch_kernel"), (MAGICS, "monarch_kernel.magics")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def imports_of(path: Path, module: str) -> set[tuple[str, tuple[str, ...]]]:
    """Every import of a file: (module, names imported from it); top level, in functions, under TYPE_CHECKING."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add((target, tuple(a.name for a in node.names)))
    return {(name, names) for name, names in found if name.startswith("monarch_kernel")}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (`from pkg import sub` counts as sub only)."""
    files = module_files()
    graph = {}
    for mod, path in files.items():
        deps = set()
        for target, names in imports_of(path, mod):
            subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in files}
            deps |= subs
            if len(subs) < len(names) or not names:
                deps.add(target)
        graph[mod] = {dep for dep in deps if dep in files and dep != mod}
    return graph


def folder_of(module: str) -> str | None:
    if module in ROOT_MODULES:
        return None
    return module.split(".")[1]


def rule_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that break a folder's rule."""
    bad = []
    for module, deps in graph.items():
        folder = folder_of(module)
        if folder is None:
            continue
        assert folder in RULES, f"{module}: folder {folder!r} has no rule; add it to RULES and docs/architecture.md"
        for dep in deps:
            target = folder_of(dep)
            if target is not None and target != folder and target not in RULES[folder] \
                    and (module, dep) not in CROSSINGS:
                bad.append(f"{module} imports {dep} ({folder}/ may import only {sorted(RULES[folder]) or 'stdlib'})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph (one path per cycle found)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_every_folder_imports_only_what_its_rule_allows():
    assert rule_violations(import_graph()) == []


def test_there_is_no_import_cycle():
    graph = import_graph()
    graph.pop("monarch_kernel")  # its TYPE_CHECKING imports are for type checkers, not cycles at run time
    assert cycles(graph) == []


def test_core_uses_only_the_standard_library():
    for module, path in module_files().items():
        if folder_of(module) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "monarch_kernel", f"{module} imports {name}"


def test_the_checks_catch_a_cycle_and_a_forbidden_import():
    graph = {
        "monarch_kernel.core.a": {"monarch_kernel.controller.b"},  # core may import nothing
        "monarch_kernel.controller.b": {"monarch_kernel.wire.c"},
        "monarch_kernel.wire.c": {"monarch_kernel.core.a"},
        "monarch_kernel.rank.d": {"monarch_kernel.api.e"},  # ranks never load the API
    }
    assert len(cycles(graph)) == 1
    bad = rule_violations(graph)
    assert any(v.startswith("monarch_kernel.core.a imports") for v in bad)
    assert any(v.startswith("monarch_kernel.rank.d imports monarch_kernel.api.e") for v in bad)


def test_the_relative_import_resolver_sees_function_level_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from ..api import mesh\n    from . import other\n")
    assert imports_of(source, "monarch_kernel.views.mod") == {("monarch_kernel.api", ("mesh",)),
                                                               ("monarch_kernel.views", ("other",))}


def _loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def test_an_agent_loads_no_notebook_code():
    """What the agent process imports before it forks ranks."""
    modules = _loaded("from monarch_kernel.agent.cli import _warm_imports; _warm_imports()")
    assert [m for m in modules if m.startswith(NOTEBOOK_ONLY) or m.split(".")[0] in HEAVY] == []
    assert "monarch_kernel.rank.worker" in modules  # it did import what ranks need


@pytest.mark.timeout(120)
def test_real_ranks_load_no_notebook_code(mesh4):
    """On real ranks (forked from the agent, so holding what it imported), after cells and actor calls."""
    from monarch_kernel import Actor, endpoint

    class Relay(Actor):
        @endpoint
        def peers(self, handle):  # an actor mesh handle travels to the rank
            return len(handle.ranks)

    relays = mesh4.spawn("arch_relays", Relay)
    assert relays.slice(gpus=0).peers.call_one(relays).get() == 4
    mesh4.run("from monarch_kernel import current_rank\ncurrent_rank()\nimport monarch_kernel\nmonarch_kernel.Actor")
    mesh4.run("from monarch_kernel.monarch.actor import *\nthis_proc()\nChannel.open()")  # Monarch's API too
    loaded = mesh4.run("import sys\nsorted(m for m in sys.modules)").values()
    for modules in loaded:
        assert [m for m in modules if m.startswith(NOTEBOOK_ONLY) or m.split(".")[0] in HEAVY] == []
        assert "monarch_kernel.rank.worker" in modules


def test_agent_entry_point_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "monarch_kernel.agent", "--help"], capture_output=True, text=True,
                         env={**os.environ}, check=True).stdout
    assert "--stdio" in out


def _product_sources(*folders: str) -> dict[Path, str]:
    """The text of every module of these folders of the package ("magics": the magics package)."""
    found = {}
    for folder in folders:
        base = MAGICS if folder == "magics" else PKG / folder
        for path in sorted(base.rglob("*.py")):
            found[path] = path.read_text()
    return found


def _lines_matching(pattern: str, sources: dict[Path, str]) -> list[str]:
    import re

    compiled = re.compile(pattern)
    return [f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}" for path, text in sources.items()
            for n, line in enumerate(text.splitlines(), 1) if compiled.search(line)]


def test_internal_operations_are_typed_messages_not_closures():
    """The notebook asks ranks for internal work with wire/ops.py operations: no function of the
    notebook's that takes the rank's Worker, and `Call` only for the user's own Mesh.call(fn)."""
    notebook_side = _product_sources("api", "actors", "monarch", "views", "magics")
    assert _lines_matching(r"lambda worker\b|def \w+\(worker\b", notebook_side) == []
    calls = _lines_matching(r"\bm\.Call\(|\bCall\(", _product_sources("api", "actors", "monarch", "controller"))
    assert [line for line in calls if "ActorCall(" not in line and "CancelCall(" not in line] == [
        line for line in calls if line.startswith("monarch_kernel/api/mesh.py") and "m.Call(rid, sealed)" in line]
    assert len([line for line in calls if "m.Call(rid, sealed)" in line]) == 1  # in Mesh.call


def test_host_operations_have_no_string_kinds():
    """An agent's operations are types (wire/ops.py), handled through a table keyed by type."""
    from dataclasses import fields

    from monarch_kernel.wire import messages, ops

    assert [f.name for f in fields(messages.HostOp)] == ["op_id", "op"]
    everywhere = _product_sources("api", "controller", "agent", "wire", "rank", "actors", "core")
    assert _lines_matching(r"\"(files|workspace)\.(put_begin|put_chunk|put_end|describe|read|checksum|prefix|list|hash|write)\"",
                           everywhere) == []
    from monarch_kernel.agent.ops import HANDLERS

    assert set(HANDLERS) == set(ops.HOST_OPERATIONS)


def test_no_capability_is_probed_with_getattr():
    """Senders, connections and agent handles declare what they can do (typed protocols)."""
    sources = _product_sources("api", "actors", "monarch", "controller", "rank", "agent", "wire")
    assert _lines_matching(r"getattr\((sender|remote|conn|here|link\.conn|link\.host\.remote)\b", sources) == []
    assert _lines_matching(r"getattr\([^)]*\"(own_rank|send_up|answer|watch_failures)\"", sources) == []


def test_the_wire_digest_covers_every_internal_operation():
    """A host whose monarch_kernel has other operations (or other fields in one) is refused at connect."""
    import dataclasses

    from monarch_kernel.wire import handshake, ops

    assert handshake.PROTOCOL == handshake._protocol_digest()
    changed = dataclasses.make_dataclass("WriteFiles", [("key", str), ("files", list)], frozen=True)
    original = ops.WriteFiles
    try:
        ops.WriteFiles = changed  # what an older agent's module would hold
        changed.__module__ = ops.__name__
        assert handshake._protocol_digest() != handshake.PROTOCOL
    finally:
        ops.WriteFiles = original
    assert handshake._protocol_digest() == handshake.PROTOCOL


def test_core_reads_no_module_of_the_layers_above_at_run_time():
    """core/ is the stdlib-only floor: no peeking into sys.modules for a layer above it."""
    assert _lines_matching(r"sys\.modules\.get\(\"monarch_kernel", _product_sources("core")) == []
