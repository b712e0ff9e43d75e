"""The wheel ships every module of the source tree, and the prebuilt JupyterLab extension where
JupyterLab looks for it; installed into a fresh environment, every module imports from it."""

import json
import os
import pathlib
import site
import subprocess
import sys
import venv
import zipfile

import pytest

import monarch_kernel

HERE = pathlib.Path(__file__).resolve().parent.parent
BUILT = HERE / "monarch_kernel" / "labextension" / "package.json"
SHARE = f"monarch_kernel-{monarch_kernel.__version__}.data/data/share/jupyter/labextensions/monarch-kernel-meshes/"
SOURCES = {"monarch_kernel": HERE / "monarch_kernel", "monarch_kernel.magics": HERE / "magics"}


def source_modules() -> list[str]:
    """Every Python module of the source tree, by the name it installs under."""
    names = []
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "labextension" in parts or "node_modules" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package, *parts)))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(HERE)], check=True, capture_output=True)
    (built,) = out.glob("monarch_kernel-*.whl")
    return built


def test_the_wheel_carries_every_module_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "monarch_kernel/monarch/actor.py" in names  # the Monarch API (it was left out once)
    missing = [module for module in source_modules()
               if module.replace(".", "/") + ".py" not in names and module.replace(".", "/") + "/__init__.py" not in names]
    assert not missing, f"not in the wheel: {missing}"


@pytest.mark.slow
def test_every_module_imports_from_the_wheel_installed_in_a_fresh_environment(wheel, tmp_path):
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                    "--target", purelib, str(wheel)], check=True, capture_output=True)
    # the dependencies (torch, IPython, ...) come from this environment's site-packages, after the
    # fresh one: a path line in a .pth file runs none of the editable install's hooks
    (pathlib.Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    script = ("import importlib, json, sys\n"
              "import monarch_kernel\n"
              "failed = {}\n"
              f"for name in {source_modules()!r}:\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except Exception as exc:\n"
              "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
              "print(json.dumps({'file': monarch_kernel.__file__, 'failed': failed}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(purelib), report["file"]  # the wheel's copy, not the source tree
    assert not report["failed"], report["failed"]


@pytest.mark.skipif(not BUILT.exists(), reason="the JupyterLab extension is not built (scripts/setup.sh builds it)")
def test_the_wheel_carries_the_prebuilt_sidebar(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = json.loads(zf.read(SHARE + "package.json"))
    assert meta["name"] == "monarch-kernel-meshes" and meta["jupyterlab"]["_build"]["load"].startswith("static/")
    assert SHARE + meta["jupyterlab"]["_build"]["load"] in names  # the entry point JupyterLab loads
    assert "monarch_kernel/magics/sidebar.py" in names  # the kernel side it talks to
