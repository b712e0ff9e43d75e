"""Raw memory mappings through libc: a private (copy-on-write) mapping that is unmapped, and then
runs a hook, when the last Python object viewing it goes. Without a usable libc, `mmap.mmap`
stands in and no hook runs."""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Any


def map_private(fd: int, nbytes: int, on_unmap: Any = None) -> Any:
    """A copy-on-write mapping of fd's first nbytes; on_unmap runs once it is unmapped (needs libc).

    Its pages are not faulted in ahead: each receiver of a push to several ranks would pay for
    every page at once (MAP_POPULATE of 64 MiB costs more than copying it), where faults on
    first touch map the file's pages in batches, and only those the rank reads.
    """
    libc = libc_or_none()
    if libc is None:  # portable fallback: copies pages on first write, faults lazily
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of a shared-memory buffer failed")
    array = (ctypes.c_char * nbytes).from_address(addr)
    weakref.finalize(array, _unmap, libc, addr, nbytes, on_unmap)
    return array


def _unmap(libc: Any, addr: int, nbytes: int, then: Any) -> None:
    libc.munmap(ctypes.c_void_p(addr), nbytes)
    if then is not None:
        then()  # only after the unmap: the file's next writer must not change pages we still see


_LIBC: list[Any] = []


def libc_or_none() -> Any:
    """This process's libc with mmap, munmap, mprotect and madvise typed (None where it cannot be loaded)."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_long]
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]
