"""Monarch programs run unchanged: each program in tests/conformance/programs, written against
`monarch.actor`, runs under the real PyTorch Monarch (torchmonarch 0.7.0, installed by scripts/test.sh
into .cache/monarch-venv) and then, with only its imports changed, under ours; what each prints must be
the same, line for line.

Only what is truly nondeterministic is normalised: Monarch's own log banner, and the order of lines a
program marks as printed concurrently (`# unordered` in its docstring sorts its lines before comparing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted((ROOT / "tests" / "conformance" / "programs").glob("*.py"))
MONARCH_PYTHON = ROOT / ".cache" / "monarch-venv" / "bin" / "python"
RUN_TIMEOUT_S = 120
_NOISE = re.compile(r"^Monarch internal logs are being written to .*$", re.M)

pytestmark = pytest.mark.slow
# programs that print differently on ours today, and why (strict: the test fails once they match)
DIFFERENT: dict[str, str] = {}  # program -> why ours prints otherwise (none now)


def monarch_missing() -> str | None:
    """Why the real Monarch cannot run here (None: it can)."""
    if not MONARCH_PYTHON.exists():
        return "scripts/test.sh installs torchmonarch==0.7.0 into .cache/monarch-venv (it was not, or failed)"
    check = subprocess.run([str(MONARCH_PYTHON), "-c", "import monarch.actor"], capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S)
    if check.returncode != 0:
        return f"torchmonarch does not import in .cache/monarch-venv: {check.stderr.strip().splitlines()[-1:]}"
    return None


def on_our_api(source: str) -> str:
    """The program with its imports of Monarch's actor, job and config modules changed to ours (and nothing else)."""
    return re.sub(r"\bmonarch\.(actor|job|config)\b", r"monarch_kernel.monarch.\1", source)


def run_both(runs: list[tuple[str, Path]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run each (python, program) at the same time (they wait on their processes more than they compute)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONARCH", "HYPERACTOR"))}
    started = [subprocess.Popen([python, str(program)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env) for python, program in runs]
    done = []
    try:
        for proc in started:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def printed(result: subprocess.CompletedProcess[str], unordered: bool) -> list[str]:
    lines = _NOISE.sub("", result.stdout).splitlines()
    lines = [line for line in lines if line.strip()]
    return sorted(lines) if unordered else lines


@pytest.fixture(scope="module")
def monarch_python() -> str:
    why = monarch_missing()
    if why is not None:
        pytest.skip(why)
    return str(MONARCH_PYTHON)


def test_the_suite_has_at_least_fifteen_programs():
    assert len(PROGRAMS) >= 15, [p.name for p in PROGRAMS]


REFERENCE_ASKED = 3  # at most, for one program: see below


@pytest.mark.parametrize("program", [
    pytest.param(p, marks=pytest.mark.xfail(reason=DIFFERENT[p.stem], strict=True)) if p.stem in DIFFERENT else p
    for p in PROGRAMS], ids=[p.stem for p in PROGRAMS])
def test_a_monarch_program_prints_the_same_on_ours(program: Path, monarch_python: str, tmp_path: Path):
    source = program.read_text()
    unordered = "# unordered" in source
    ours_program = tmp_path / program.name
    ours_program.write_text(on_our_api(source))
    theirs, ours = run_both([(monarch_python, program), (sys.executable, ours_program)], tmp_path)
    asked = 1
    while (program.stem not in DIFFERENT and printed(ours, unordered) != printed(theirs, unordered)
           and asked < REFERENCE_ASKED):
        # The real Monarch is the reference, with flakes of its own on a loaded machine (once, in CI, program
        # 30's fault hook did not fire within 30 s; with busy loops beside it, program 01 aborted twice in a row
        # in Monarch's runtime: "FATAL: exception not rethrown"): ask it again, alone. Ours is never re-run.
        (theirs,) = run_both([(monarch_python, program)], tmp_path)
        asked += 1
    assert theirs.returncode == 0, f"the real Monarch failed on {program.name}:\n{theirs.stderr[-3000:]}"
    assert ours.returncode == 0, f"ours failed on {program.name}:\n{ours.stdout[-2000:]}\n{ours.stderr[-3000:]}"
    assert printed(ours, unordered) == printed(theirs, unordered), (
        f"{program.name}: ours printed\n{ours.stdout}\nMonarch printed\n{theirs.stdout}")
