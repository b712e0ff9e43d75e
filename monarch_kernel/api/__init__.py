"""The user's API in the notebook's process: meshes, futures, output sinks."""

from monarch_kernel.api import actor_procs as _actor_procs  # noqa: F401 - the notebook starts processes for actors
