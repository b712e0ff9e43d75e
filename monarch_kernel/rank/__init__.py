"""Code that runs in a rank process: the worker loop, cells, output capture, actors it hosts."""
