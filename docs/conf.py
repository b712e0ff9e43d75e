"""Sphinx configuration of monarch-kernel's documentation (built by scripts/test.sh with warnings as errors)."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import monarch_kernel  # noqa: E402

project = "monarch-kernel"
author = "the monarch-kernel developers"
release = version = monarch_kernel.__version__
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the example notebooks are shown with the outputs saved in them
html_theme = "furo"
html_title = f"monarch-kernel {release}"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
suppress_warnings = ["myst.header"]
nitpicky = False


def _copy_notebooks(app: object) -> None:
    """The example notebooks live in notebooks/ (beside the code they import); the docs show copies."""
    target = os.path.join(HERE, "examples")
    os.makedirs(target, exist_ok=True)
    for name in sorted(os.listdir(os.path.join(ROOT, "notebooks"))):
        if name.endswith(".ipynb") and not name.endswith(".executed.ipynb"):
            with open(os.path.join(ROOT, "notebooks", name)) as f:
                notebook = json.load(f)
            # magics and shell lines: highlighted as IPython, not plain Python
            notebook.setdefault("metadata", {})["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
            with open(os.path.join(target, name), "w") as f:
                json.dump(notebook, f)


def setup(app: object) -> None:
    """Sphinx's hook: copy the notebooks in before the build reads its sources."""
    app.connect("builder-inited", _copy_notebooks)  # type: ignore[attr-defined]
