"""Buffers through shared memory on one host: written once, mapped by the receivers, and their
files recycled (never while anyone still maps them), with nothing left behind."""

import collections
import gc
import os
import time

import numpy as np
import pytest
import torch

from monarch_kernel import local_mesh
from monarch_kernel.wire import shm_pool
from monarch_kernel.wire.serialization import release, seal, unseal

MIB = 1 << 20


def _files(folder: str, prefix: str) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(prefix)]


def _wait_until_released(folder: str, timeout: float = 10.0) -> None:
    """Until no buffer is held (every receiver's object is gone and its file recycled)."""
    deadline = time.monotonic() + timeout
    while _files(folder, "buf-") or _files(folder, "hold-"):
        gc.collect()
        assert time.monotonic() < deadline, f"still held: {sorted(os.listdir(folder))}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pair():
    with local_mesh(gpus=2, dist="none", preload=["numpy"]) as mesh:
        yield mesh


def test_a_thousand_pulls_reuse_files_and_never_touch_a_value_still_held(pair, sink):
    folder = pair._runtime.state.shm_dir
    pair.run("import numpy as np\nn = 0\ndef next_block():\n    global n\n    n += 1\n"
             "    return np.full(1 << 20, n % 251, dtype=np.uint8)", sink=sink)
    _pull_a_thousand(pair.slice(gpus=0))
    assert len(os.listdir(folder)) < 60, sorted(os.listdir(folder))  # a pool the size of what is held
    _wait_until_released(folder)
    assert all(int(n.split("-")[1]) == MIB for n in _files(folder, "free-"))


def _pull_a_thousand(one) -> None:
    held: collections.deque = collections.deque(maxlen=20)  # pulled values still alive while more arrive
    for i in range(1, 1001):
        (value,) = list(one.pull("next_block()").values())
        assert value.nbytes == MIB and value[0] == value[-1] == i % 251
        if i % 7 == 0:
            value[:4096] = 0  # the receiver may write: its own copy of that page, never the file's
        held.append((i, value))
        for j, old in held:
            assert old[-1] == j % 251 and old[MIB // 2] == j % 251  # what was pulled before is as it was


def test_a_pulled_tensor_that_needs_a_copy_arrives_in_host_memory_and_its_file_is_recycled(pair, sink):
    folder = pair._runtime.state.shm_dir
    one = pair.slice(gpus=0)
    one.run("import torch\nt = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024).T", sink=sink)
    expected = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024).T
    for _ in range(50):
        (value,) = list(one.pull("t", device="cpu").values())
        assert value.device.type == "cpu" and torch.equal(value, expected)
    del value
    _wait_until_released(folder)
    assert len(_files(folder, f"free-{4 * MIB}-")) <= 3, sorted(os.listdir(folder))  # one file, reused


def test_a_pull_to_a_named_device_puts_its_tensors_there(pair):
    # "meta" is a device every torch build has: the same path as "cuda:0" on a GPU host
    (value,) = list(pair.slice(gpus=0).pull("{'t': __import__('torch').ones(3)}", device="meta").values())
    assert value["t"].device.type == "meta" and value["t"].shape == (3,)
    (value,) = list(pair.slice(gpus=0).pull("__import__('torch').ones(3)").values())
    assert value.device.type == "cpu"


def test_a_pull_to_a_device_this_process_cannot_use_says_so(pair):
    from monarch_kernel import MeshUsageError

    with pytest.raises(MeshUsageError, match="not a torch device"):
        pair.pull("1", device="gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(MeshUsageError, match="no CUDA device"):
            pair.pull("1", device="cuda:0")


def test_a_push_is_written_once_and_recycled_when_every_rank_lets_go(pair, sink):
    folder = pair._runtime.state.shm_dir
    pair.run("kept = []", sink=sink)
    for i in range(12):
        pair.push(x=np.full(4 * MIB, i, dtype=np.uint8))
        pair.run("kept.append(x)", sink=sink)
    sums = pair.run("[(int(k[0]), int(k[-1])) for k in kept]", sink=sink)
    assert list(sums.values()) == [[(i, i) for i in range(12)]] * 2  # every push intact on every rank
    assert len(_files(folder, "buf-")) == 12  # each push written once for both ranks, held while kept
    pair.run("kept.clear()\ndel x\nimport gc\ngc.collect()", sink=sink)
    _wait_until_released(folder)
    assert _files(folder, "free-")  # ready for the next push


RESIDENT = ("def resident(name):\n"
            "    with open('/proc/self/smaps') as f:\n"
            "        lines = f.read().splitlines()\n"
            "    total, inside = 0, False\n"
            "    for line in lines:\n"
            "        if '-' in line.split(' ', 1)[0]:\n"
            "            inside = name in line\n"
            "        elif inside and line.startswith('Rss:'):\n"
            "            total += int(line.split()[1]) * 1024\n"
            "    return total\n")


def test_a_push_to_several_local_ranks_is_mapped_by_each_not_copied(pair, sink):
    """A push to several local ranks cost one copy per rank (4.7x a memcpy for 4): every rank
    pre-faulted all of its pages. Each maps the one file the notebook wrote, and copies only what it writes."""
    pair.run(RESIDENT, sink=sink)
    pair.push(big=torch.arange(16 * MIB, dtype=torch.int32))  # 64 MiB
    files = pair.run("import os\nsorted(set(os.path.basename(line.split()[-1]) for line in open('/proc/self/maps') "
                     "if 'buf-' in line))", sink=sink)
    (mapped,) = set(tuple(v) for v in files.values())  # both ranks map the same file
    assert len(mapped) == 1
    before = pair.run(f"resident({mapped[0]!r})", sink=sink)
    assert all(v < 4 * MIB for v in before.values()), before  # nothing copied or faulted in ahead
    pair.run("import os\nbig[:1024] = -1 - int(os.environ['RANK'])", sink=sink)  # each writes its own pages
    heads = pair.run("(int(big[0]), int(big[1024]), int(big[-1]))", sink=sink)
    assert heads.by_rank() == {0: (-1, 1024, 16 * MIB - 1), 1: (-2, 1024, 16 * MIB - 1)}
    pair.run("del big\nimport gc\ngc.collect()", sink=sink)


def test_the_mesh_folder_goes_with_the_mesh(sink):
    with local_mesh(gpus=1, dist="none") as mesh:
        folder = mesh._runtime.state.shm_dir
        mesh.run("import numpy as np\nx = np.ones(2 << 20, dtype=np.uint8)", sink=sink)
        (value,) = mesh.pull("x").values()
        assert os.path.isdir(folder)
    assert not os.path.exists(folder)
    assert value.sum() == 2 << 20  # a value pulled before stays readable after the mesh is gone
    assert _mapped_here(folder)
    del value
    gc.collect()
    assert not _mapped_here(folder)  # and once it is gone, this process keeps nothing of the folder


def _mapped_here(folder: str) -> bool:
    with open("/proc/self/maps") as maps:
        return folder in maps.read()


@pytest.mark.unit
def test_the_free_pool_is_bounded(tmp_path, monkeypatch):
    folder = tmp_path / "monarch-pool"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(shm_pool, "SHM_POOL_BYTES", 8 * MIB)
    values = [unseal(seal(np.full(size, 1, dtype=np.uint8), shm_dir=str(folder)))
              for size in (MIB, 2 * MIB, 4 * MIB, 4 * MIB)]
    del values
    gc.collect()
    free = _files(str(folder), "free-")
    assert sum(int(n.split("-")[1]) for n in free) == 11 * MIB  # four free files; the next claim trims them
    unseal(seal(np.full(16 * MIB, 1, dtype=np.uint8), shm_dir=str(folder)))
    gc.collect()
    assert sum(int(n.split("-")[1]) for n in _files(str(folder), "free-")) <= 8 * MIB + 16 * MIB


@pytest.mark.unit
def test_a_shared_buffer_outlives_the_sender_until_every_receiver_lets_go(tmp_path):
    folder = tmp_path / "monarch-shared"
    folder.mkdir(mode=0o700)
    sealed = seal(np.arange(MIB, dtype=np.uint8), shm_dir=str(folder), shared=True)
    first, second = unseal(sealed), unseal(sealed)
    release(sealed)  # every receiver answered; both still map it
    assert len(_files(str(folder), "buf-")) == 1 and len(_files(str(folder), "hold-")) == 2
    del first
    gc.collect()
    assert _files(str(folder), "buf-") and not _files(str(folder), "free-")
    claimed = seal(np.zeros(MIB, dtype=np.uint8), shm_dir=str(folder))  # may not take the held file
    assert int(second[-1]) == (MIB - 1) % 256 and unseal(claimed).sum() == 0
    del second
    gc.collect()
    assert not _files(str(folder), "hold-") and len(_files(str(folder), "free-")) >= 1
