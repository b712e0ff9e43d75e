"""What the Slurm layer asks Slurm and how it reads the answers (no cluster needed)."""

import pytest

from monarch_kernel.controller.slurm import HOLD_SCRIPT, SlurmRequest, _hint, time_left_seconds

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


@pytest.mark.parametrize("text, seconds", [("1-02:03:04", 93784), ("2:03:04", 7384), ("3:04", 184), ("59", 59),
                                           ("UNLIMITED", None), ("INVALID", None), ("NOT_SET", None)])
def test_time_left_as_squeue_prints_it(text, seconds):
    assert time_left_seconds(text) == seconds


def test_the_sbatch_command_carries_every_choice_and_no_script():
    request = SlurmRequest(nodes=2, gpus=8, partition="gpu", time="2:00:00", account="a", qos="q", constraint="h100",
                           sbatch_args=("--exclusive",), name="train")
    cmd = request.sbatch_command("#!/bin/sh\n")
    assert cmd[:2] == ["sbatch", "--parsable"] and "--nodes=2" in cmd and "--gpus-per-node=8" in cmd
    for flag in ("--partition=gpu", "--time=2:00:00", "--account=a", "--qos=q", "--constraint=h100",
                 "--job-name=monarch-train", "--exclusive"):
        assert flag in cmd
    assert not any("#!" in word for word in cmd)  # the script goes on stdin
    assert "--gpus-per-node=8" not in SlurmRequest(gpus=8, request_gpus=False).sbatch_command("")


def test_a_refusal_gets_a_hint_that_fits():
    assert "sinfo -s" in _hint("invalid partition specified: nope", SlurmRequest())
    assert "sacctmgr" in _hint("invalid account or account/partition combination", SlurmRequest())
    assert "more than the partition has" in _hint("Node count specification invalid", SlurmRequest(nodes=9))
    assert "shorter --time" in _hint("Requested time limit is invalid (missing or exceeds some limit)", SlurmRequest())


def test_the_holding_script_ends_the_job_when_the_agents_are_gone():
    script = HOLD_SCRIPT.format(grace=600)
    assert "squeue -h -s -j" in script and "exit 0" in script and "sleep infinity" not in script
