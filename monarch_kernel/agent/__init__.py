"""The host agent process: forks and supervises a host's ranks and routes their messages.

`python -m monarch_kernel.agent --fd N --host NAME` (or `--stdio` over SSH) runs it.
"""
