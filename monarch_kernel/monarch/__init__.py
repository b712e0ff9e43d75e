"""Monarch's API on monarch-kernel: run a PyTorch Monarch program with one import changed.

    from monarch.actor import Actor, endpoint, this_host      # Monarch
    from monarch_kernel.monarch.actor import Actor, endpoint, this_host   # here

`monarch_kernel.monarch.actor` offers what programs import from `monarch.actor`. The
README's "Coming from Monarch" section lists where behaviour differs.
"""
