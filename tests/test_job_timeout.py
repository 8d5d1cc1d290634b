"""A hung multi-process test fails, with each rank's stacks or the command's output, instead of
hanging the suite (tests/gloo.py's spawn_collecting and run_job)."""
from __future__ import annotations

import sys
import time

import pytest

from gloo import run_job, spawn_collecting


def _hung_rank(rank, errors):
    if rank == 1:
        while True:  # a rank waiting forever, as on a stale build lock
            time.sleep(0.1)


def test_a_hung_spawned_job_fails_with_the_ranks_stacks():
    # ranks fork from the preloaded forkserver (start() returns once they exist): well within
    # the timeout each is in its loop, with its stack handler registered
    with pytest.raises(pytest.fail.Exception) as failed:
        spawn_collecting(_hung_rank, (), 2, timeout=8)
    message = str(failed.value)
    assert "still running after 8 s" in message, message
    assert "rank 1 (running)" in message and "_hung_rank" in message, message


def test_a_hung_command_fails_with_its_output():
    code = "import time; print('rank 0 waiting on the build lock', flush=True); time.sleep(600)"
    with pytest.raises(pytest.fail.Exception) as failed:
        run_job([sys.executable, "-c", code], timeout=5)  # the interpreter prints within a second
    assert "still running after 5 s" in str(failed.value)
    assert "rank 0 waiting on the build lock" in str(failed.value)
