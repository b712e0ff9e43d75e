"""The unit tier's promise, checked: a test marked `unit` cannot start a process."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_a_unit_test_that_starts_a_process_fails_at_once():
    with pytest.raises(RuntimeError, match="a unit test may not start processes"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with pytest.raises(RuntimeError, match="a unit test may not start processes"):
        os.fork()
