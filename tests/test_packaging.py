"""The wheel ships the prebuilt JupyterLab extension where JupyterLab looks for it."""

import json
import os
import subprocess
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = os.path.join(HERE, "monarch_kernel", "labextension", "package.json")
SHARE = "monarch_kernel-0.1.0.data/data/share/jupyter/labextensions/monarch-kernel-meshes/"


@pytest.mark.skipif(not os.path.exists(BUILT), reason="the JupyterLab extension is not built (scripts/setup.sh builds it)")
def test_the_wheel_carries_the_prebuilt_sidebar(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp_path), HERE], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("monarch_kernel-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = json.loads(zf.read(SHARE + "package.json"))
    assert meta["name"] == "monarch-kernel-meshes" and meta["jupyterlab"]["_build"]["load"].startswith("static/")
    assert SHARE + meta["jupyterlab"]["_build"]["load"] in names  # the entry point JupyterLab loads
    assert "monarch_kernel/magics/sidebar.py" in names  # the kernel side it talks to
