import gc
import os
import pickle
import threading

import numpy as np
import pytest
import torch

from monarch_kernel.core.errors import SerializationError
from monarch_kernel.wire.serialization import SHM_THRESHOLD, Sealed, ShmRef, release, seal, unseal

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.bool, torch.complex64, torch.uint8, torch.float16])
def test_tensors_round_trip_bit_exact(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    back = unseal(seal(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensor_data_travels_out_of_band():
    t = torch.arange(1 << 16, dtype=torch.float32)
    sealed = seal(t)
    assert len(sealed.data) < 1024  # the 256 KiB of data is not in the pickle stream
    assert sum(memoryview(b).nbytes for b in sealed.buffers) == t.numel() * 4


def test_views_empty_and_scalar_tensors():
    base = torch.arange(24.0).reshape(4, 6)
    for t in (base.t(), base[:, ::2], torch.empty(0, 3), torch.tensor(3.5), base[1]):
        back = unseal(seal(t))
        assert back.shape == t.shape and torch.equal(back, t)


def test_requires_grad_is_kept_and_parameters_work():
    t = torch.ones(3, requires_grad=True)
    assert unseal(seal(t)).requires_grad
    model = torch.nn.Linear(3, 2)
    back = unseal(seal(model))
    assert torch.equal(back.weight, model.weight)


def test_numpy_and_nested_values():
    value = {"a": np.arange(10.0), "b": [torch.ones(2), "text"], "c": (1, None)}
    back = unseal(seal(value))
    assert np.array_equal(back["a"], value["a"]) and torch.equal(back["b"][0], torch.ones(2))
    assert back["b"][1] == "text" and back["c"] == (1, None)


def test_notebook_functions_and_classes_travel_by_value():
    class Scaler:
        def __init__(self, k):
            self.k = k

        def __call__(self, x):
            return x * self.k

    fn = lambda x: Scaler(3)(x) + 1  # noqa: E731
    assert unseal(seal(fn))(2) == 7


@pytest.fixture
def shm_dir(tmp_path):
    """A mesh's private shared-memory folder (0700, named like the real ones)."""
    folder = tmp_path / "monarch-test"
    folder.mkdir(mode=0o700)
    return str(folder)


def test_large_buffers_go_through_shared_memory(shm_dir):
    t = torch.arange(SHM_THRESHOLD // 4 * 2, dtype=torch.float32)
    sealed = seal(t, shm_dir=shm_dir)
    refs = [b for b in sealed.buffers if isinstance(b, ShmRef)]
    assert len(refs) == 1 and os.path.exists(refs[0].path)
    # the envelope (as the agent forwards it) carries the reference, not the data
    assert len(pickle.dumps(sealed, protocol=5)) < 4096
    back = unseal(sealed)
    assert torch.equal(back, t)
    back += 1  # private, writable mapping
    assert back[0].item() == 1.0
    assert os.path.exists(refs[0].path)  # kept while the receiver maps it...
    del back
    gc.collect()
    assert not os.path.exists(refs[0].path)  # ...then free for the next buffer of its size
    assert [n for n in os.listdir(shm_dir) if n.startswith("free-")]


def test_a_tensor_that_needs_a_copy_is_copied_once_straight_into_shared_memory(shm_dir, monkeypatch):
    # a transposed tensor (as one on a GPU) must be copied to become bytes: that copy writes the
    # shared-memory file itself, with no contiguous staging copy (made by .contiguous()) first
    base = torch.arange(SHM_THRESHOLD // 2, dtype=torch.float32).reshape(512, -1)
    t, u = base.T, (base * 2).T
    staged = []
    real_contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **k: staged.append(1) or real_contiguous(self, *a, **k))
    sealed = seal({"t": t, "u": u, "t again": t}, shm_dir=shm_dir, shared=True)
    monkeypatch.undo()
    assert not staged
    refs = [b for b in sealed.buffers if isinstance(b, ShmRef)]
    assert len(refs) == 2 and all(r.held for r in refs)
    back = unseal(sealed)
    assert torch.equal(back["t"], t) and back["t"].is_contiguous() and torch.equal(back["u"], u)
    assert back["t again"] is back["t"]
    release(sealed)
    del back
    gc.collect()
    assert not [n for n in os.listdir(shm_dir) if n.startswith(("buf-", "hold-"))]


def test_a_value_that_fails_to_pickle_leaves_no_file_behind(shm_dir):
    with pytest.raises(SerializationError):
        seal([torch.zeros(1024, 1024, dtype=torch.uint8).T, torch.ones(512, 1024).T,
              threading.Lock()], shm_dir=shm_dir)
    assert not [n for n in os.listdir(shm_dir) if n.startswith(("buf-", "hold-"))]


def test_a_value_whose_getstate_raises_is_a_runtime_error_that_says_what_it_raised():
    """As Monarch's (its test_broken_pickle_class): a RuntimeError, raised where the value is sent."""

    class Broken:
        def __getstate__(self):
            raise RuntimeError("__getstate__ error: cannot")

    with pytest.raises(RuntimeError, match="__getstate__ error: cannot") as info:
        seal(((Broken(),), {}))
    assert isinstance(info.value, SerializationError)


def test_shared_buffers_are_copy_on_write_and_released_by_sender(shm_dir):
    t = torch.zeros(SHM_THRESHOLD // 4 * 2)
    sealed = seal({"x": t}, shm_dir=shm_dir, shared=True)
    first, second = unseal(sealed)["x"], unseal(sealed)["x"]
    first += 1
    assert second.sum().item() == 0  # one receiver's writes are invisible to another
    assert all(os.path.exists(p) for p in sealed.shm_paths())
    release(sealed)
    assert all(os.path.exists(p) for p in sealed.shm_paths())  # both receivers still map it
    del first, second
    gc.collect()
    assert not any(os.path.exists(p) for p in sealed.shm_paths())  # the last one let go: recycled


def test_unpicklable_value_names_the_variable():
    with pytest.raises(SerializationError, match="variable 'lock'.*cannot pickle"):
        seal(threading.Lock(), name="lock")


def test_sealed_blob_survives_an_envelope_without_copying_buffers():
    t = torch.arange(1000)
    chunks = []
    meta = pickle.dumps(seal(t), protocol=5, buffer_callback=chunks.append)
    inner = pickle.loads(meta, buffers=[bytearray(c.raw()) for c in chunks])
    assert isinstance(inner, Sealed) and torch.equal(unseal(inner), t)
