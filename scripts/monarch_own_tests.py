"""Run PyTorch Monarch's own actor-API tests against the real torchmonarch, then against ours.

    python scripts/monarch_own_tests.py MONARCH_CHECKOUT [--only FILE ...] [--keep DIR]

MONARCH_CHECKOUT is a clone of meta-pytorch/monarch (its `python/tests/` is read, never copied
into this repository). Each test file runs first under the real Monarch (`.cache/monarch-venv`,
which `scripts/test.sh` installs); the tests that pass there then run with `monarch` mapped to
`monarch_kernel.monarch` (a package on PYTHONPATH whose `monarch.actor` is ours). Monarch's
internal modules (`monarch._src...`, `monarch._rust_bindings...`) are mapped name by name to our
public names where we have one; any other internal name imports, but fails the test that uses it.
The table counts, per file, the tests that pass under Monarch and how many of them pass on ours.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MONARCH_PYTHON = ROOT / ".cache" / "monarch-venv" / "bin" / "python"
OUR_PYTHON = ROOT / ".venv" / "bin" / "python"
PLUGINS = ROOT / ".cache" / "own-tests-plugins"  # pytest-asyncio for our side (not in the main environment)
TEST_TIMEOUT_S = 90
PARALLEL = 2  # tests run at a time
RUN_MARKER = "MONARCH_OWN_TESTS_RUN"  # in the environment of every process of one test

# Monarch's tests of its actor API (calls, meshes, concurrency, supervision, lifecycle, ports, logging)
ACTOR_API_FILES = (
    "test_python_actors.py",
    "test_actor_error.py",
    "test_supervision_hierarchy.py",
    "test_concurrent_endpoints.py",
    "test_host_mesh.py",
    "test_proc_mesh.py",
    "test_actor_logging.py",
    "test_port_forward.py",
    "test_client_shutdown.py",
    "test_inter_mesh_ping_pong.py",
)

# `monarch` on our side: `monarch.actor` is ours; other modules resolve names to ours or to a stand-in
# that fails whoever uses it (so a test file imports, and only the tests that need the internal fail).
_SHIM = '''
"""`monarch` mapped to monarch_kernel.monarch, for running Monarch's own tests against ours."""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

import monarch_kernel.monarch.actor as _actor
import monarch_kernel.monarch.config as _config
import monarch_kernel.monarch.job as _job

_OURS = (_actor, _job, _config)  # where a name of Monarch's internal modules is looked for

_MAPPED = {"monarch.actor": "monarch_kernel.monarch.actor", "monarch.config": "monarch_kernel.monarch.config",
           "monarch.job": "monarch_kernel.monarch.job"}


class _Internal:
    """A name of Monarch's that ours does not have: using it fails the test that does."""

    def __init__(self, where):
        self._where = where

    def _fail(self, *args, **kwargs):
        raise NotImplementedError(f"{self._where} is not part of monarch_kernel.monarch")

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Internal(f"{self._where}.{name}")

    def __mro_entries__(self, bases):  # a class built on it can be defined; making one fails
        return (type(self._where.rsplit(".", 1)[-1], (), {"__init__": self._fail}),)


def _missing(where, name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Internal(f"{where}.{name}")


class _Lenient(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        for module in _OURS:
            found = getattr(module, name, None)
            if found is not None and not isinstance(found, _Internal):
                return found
        return _Internal(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("monarch.") :
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        target = _MAPPED.get(spec.name)
        if target is not None:
            try:
                module = importlib.import_module(target)
            except ImportError:
                pass
            else:  # a name ours lacks imports, but fails the test that uses it (so each test counts on its own)
                module.__getattr__ = lambda name, _where=spec.name: _missing(_where, name)
                return module
        module = _Lenient(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
'''


def collect(python: Path, tests_dir: Path, files: list[str], env: dict[str, str]) -> list[str]:
    """The test ids (file::name[params]) in these files, as pytest collects them."""
    out = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=tests_dir, env=env, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def run_one(python: Path, tests_dir: Path, test: str, env: dict[str, str]) -> tuple[str, str]:
    """(test, "passed" | "failed" | "skipped" | "timeout"): one test in a pytest of its own, in a process
    group of its own that is killed after (a hang inside native code cannot stop pytest-timeout's signal)."""
    cmd = [str(python), "-m", "pytest", test, "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
           f"--timeout={TEST_TIMEOUT_S}", "--tb=no", "-rN"]
    marker = uuid.uuid4().hex  # every process the test starts inherits it (some start sessions of their own)
    proc = subprocess.Popen(cmd, cwd=tests_dir, env=dict(env, **{RUN_MARKER: marker}), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TEST_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        return test, "timeout"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # (nothing of it may linger)
        except ProcessLookupError:
            pass
        proc.wait()
        kill_marked(marker)
    tail = (out.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 and "passed" in tail:
        return test, "passed"
    return test, "skipped" if "skipped" in tail and "failed" not in tail else "failed"


def kill_marked(marker: str) -> None:
    """Kill every process whose environment carries this test's marker (what it left running)."""
    wanted = f"{RUN_MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def run_all(python: Path, tests_dir: Path, tests: list[str], env: dict[str, str]) -> dict[str, str]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        return dict(pool.map(lambda t: run_one(python, tests_dir, t, env), tests))


def ensure_plugins() -> None:
    subprocess.run([str(MONARCH_PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "pytest", "pytest-asyncio", "pytest-timeout", "cloudpickle"], check=True)
    if not (PLUGINS / "pytest_asyncio").exists():
        subprocess.run([str(OUR_PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(PLUGINS), "pytest-asyncio"], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a clone of meta-pytorch/monarch")
    parser.add_argument("--only", nargs="*", default=None, help="test files to run (default: the actor-API ones)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the reports and the shim here")
    parser.add_argument("--theirs", type=Path, default=None,
                        help="a theirs.json of an earlier run (same checkout): skip the run under Monarch")
    args = parser.parse_args()
    tests = args.checkout / "python" / "tests"
    if not tests.is_dir():
        print(f"{tests} is not there: pass a clone of meta-pytorch/monarch", file=sys.stderr)
        return 2
    ensure_plugins()
    files = [f for f in (args.only or ACTOR_API_FILES) if (tests / f).exists()]
    work = args.keep or Path(tempfile.mkdtemp(prefix="monarch-own-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    copy = work / "tests"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(tests, copy)
    shim = work / "shim"
    (shim / "monarch").mkdir(parents=True, exist_ok=True)
    (shim / "monarch" / "__init__.py").write_text(_SHIM)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MONARCH", "HYPERACTOR", "PYTHONPATH"))}
    if args.theirs is not None:
        theirs_results = {t: r for t, r in json.loads(args.theirs.read_text()).items() if t.split("::")[0] in files}
    else:
        theirs_results = run_all(MONARCH_PYTHON, copy, collect(MONARCH_PYTHON, copy, files, base), base)
    theirs = {t for t, r in theirs_results.items() if r == "passed"}
    (work / "theirs.json").write_text(json.dumps(theirs_results, indent=1))
    ours_env = dict(base, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT), str(PLUGINS)]))
    ours_results = run_all(OUR_PYTHON, copy, sorted(theirs), ours_env)
    (work / "ours.json").write_text(json.dumps(ours_results, indent=1))
    ours = {t for t, r in ours_results.items() if r == "passed"}
    print(f"{'file':40} {'pass on Monarch':>16} {'pass on ours':>13}")
    for file in files:
        mine = sorted(t for t in theirs if t.startswith(file + "::"))
        print(f"{file:40} {len(mine):>16} {sum(t in ours for t in mine):>13}")
    total = len(theirs)
    share = 100 * len(ours) / total if total else 0.0
    print(f"{'all':40} {total:>16} {len(ours):>13}  ({share:.0f}%)")
    for test in sorted(theirs - ours):
        print(f"  fails on ours: {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
