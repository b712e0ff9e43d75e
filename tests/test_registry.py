import pytest

from monarch_kernel.core.errors import MeshNotRunningError, MeshUsageError
from monarch_kernel.magics.registry import MeshRegistry

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


class FakeMesh:
    """Only what the registry touches: a name, shutdown() and leave() (what the kernel's end does)."""

    def __init__(self, name):
        self.name = name
        self.down = self.left = False

    def shutdown(self):
        self.down = True

    def leave(self):
        self.left = True


def test_newest_is_default_and_use_switches():
    reg = MeshRegistry()
    with pytest.raises(MeshNotRunningError, match="%mesh up local"):
        reg.get()
    a, b = FakeMesh("a"), FakeMesh("b")
    reg.add(a)
    reg.add(b)
    assert reg.get() is b and reg.use("a") is a and reg.get() is a
    with pytest.raises(MeshUsageError, match="already up"):
        reg.add(FakeMesh("a"))
    with pytest.raises(MeshUsageError, match="meshes up: a, b"):
        reg.get("c")
    reg.remove("a")
    assert reg.current == "b"
    reg.shutdown_all()
    assert b.left and not b.down and reg.names() == []  # (a persistent mesh waits for the next kernel)
