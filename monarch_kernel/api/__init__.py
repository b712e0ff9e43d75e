"""The user's API in the notebook's process: meshes, futures, output sinks."""
