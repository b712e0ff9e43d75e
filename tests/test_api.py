"""The public surface and the layering contract."""

import ast
import os
import subprocess
import sys

import monarch_kernel

PKG = os.path.dirname(monarch_kernel.__file__)
LAYERS = [
    {"errors", "errortext", "shape", "messages", "serialization", "sharding", "termtext"},  # values
    {"transport", "lanes", "ssh"},  # I/O
    {"cell", "capture", "calls", "actor_host", "load", "dist", "rankshell", "worker", "launcher", "hosts", "agent",
     "callrouter",
     "runstate", "controller"},  # runtime
    {"futures", "sinks", "values", "actors", "mesh"},  # API
    {"output", "live", "statusview", "shardview", "timing", "meshview", "meshwidget",
     "viewwidgets"},  # views
]


def test_public_names():
    assert set(monarch_kernel.__all__) == {
        "Actor", "ActorDiedError", "ActorError", "ActorFailureEvent", "ActorFuture", "ActorMesh",
        "current_rank", "endpoint", "visualize_sharding",
        "CellSyntaxError", "Mesh", "MeshError", "MeshFuture", "MeshInterrupted", "MeshNotRunningError",
        "MeshStartError", "MeshTimeoutError", "MeshUsageError", "Point", "RankDiedError", "RankFailure",
        "RemoteError", "SerializationError", "Shape", "ValueMesh", "load_ipython_extension", "local_mesh",
        "ssh_mesh", "unload_ipython_extension"}
    for name in monarch_kernel.__all__:
        assert getattr(monarch_kernel, name).__doc__, name


def _module_imports(name):
    tree = ast.parse(open(os.path.join(PKG, f"{name}.py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update(alias.name for alias in node.names)
    return found


def test_imports_flow_down_the_layers_only():
    layer_of = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    for module, layer in layer_of.items():
        for dep in _module_imports(module):
            if dep in layer_of:
                assert layer_of[dep] <= layer, f"{module} (layer {layer}) imports {dep} (layer {layer_of[dep]})"


def test_every_module_is_in_a_layer():
    modules = {f[:-3] for f in os.listdir(PKG) if f.endswith(".py") and not f.startswith("__")}
    assert modules == set().union(*LAYERS)


def test_ranks_start_light():
    code = ("import sys, monarch_kernel.worker, monarch_kernel.agent\n"
            "heavy = [m for m in ('IPython', 'rich', 'ipywidgets') if m in sys.modules]\nprint(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
