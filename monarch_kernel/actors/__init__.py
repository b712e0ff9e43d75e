"""Handles on actor meshes: calls, futures and replies; used in the notebook and on ranks."""
