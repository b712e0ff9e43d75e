"""IPython magics of monarch_kernel (installed as monarch_kernel.magics)."""

from .extension import current_mesh, current_registry, load_ipython_extension, unload_ipython_extension
from .mesh_magic import MeshMagics

__all__ = ["MeshMagics", "current_mesh", "current_registry", "load_ipython_extension", "unload_ipython_extension"]
