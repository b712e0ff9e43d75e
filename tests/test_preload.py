"""The agent forks ranks only once the import thread has left the process, thread-exit destructors
and all (MKL frees its buffers there under a lock; a fork in that window hung a rank's first matmul)."""

import asyncio
import os
import sys
import textwrap

import pytest

from monarch_kernel.agent.preload import Preloader, until_thread_gone

pytestmark = pytest.mark.unit

EXIT_DELAY_S = 0.3

# imported on the preload thread: a C thread-exit destructor (like MKL's) that takes EXIT_DELAY_S;
# the destructor is libc's usleep itself, called with the value stored for the key (microseconds)
SLOW_EXIT_MODULE = textwrap.dedent(f"""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    key = ctypes.c_uint()
    assert libc.pthread_key_create(ctypes.byref(key), libc.usleep) == 0
    assert libc.pthread_setspecific(key, ctypes.c_void_p({int(EXIT_DELAY_S * 1e6)})) == 0
""")


def test_ready_returns_only_after_the_import_thread_ran_its_exit_destructors(tmp_path, monkeypatch):
    (tmp_path / "slow_thread_exit_module.py").write_text(SLOW_EXIT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))

    async def preload_and_wait() -> int:
        preloader = Preloader()
        preloader.start(("slow_thread_exit_module",))
        await preloader.ready()
        assert preloader._thread is not None and preloader._thread.native_id is not None
        return preloader._thread.native_id

    try:
        tid = asyncio.run(preload_and_wait())
        assert not os.path.exists(f"/proc/self/task/{tid}")  # a fork now copies no half-exited thread
    finally:
        sys.modules.pop("slow_thread_exit_module", None)


def test_a_thread_that_never_leaves_is_named_rather_than_waited_for_forever():
    async def wait_for_self() -> None:
        import threading

        await until_thread_gone(threading.get_native_id(), timeout=0.05)

    with pytest.raises(RuntimeError, match=r"did not exit within .* leave it out of preload"):
        asyncio.run(wait_for_self())
