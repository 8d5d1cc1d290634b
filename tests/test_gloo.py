"""The spawned gloo jobs of tests/gloo.py: ranks fork from a forkserver that imported torch and
transformers but runs no thread (forking a process with threads can copy a held lock), each
rank sees the environment the test has when it starts the job, and a failing case fails the
test with its rank, case and traceback."""
from __future__ import annotations

import os

import pytest

from gloo import spawn_cases


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _check_rank(case, rank, world):
    import sys

    server = os.getppid()
    assert "forkserver" in open(f"/proc/{server}/cmdline").read(), "the rank is not a fork of the forkserver"
    assert _threads(server) == 1, f"the forkserver runs {_threads(server)} threads"
    assert "transformers.modeling_utils" in sys.modules  # preloaded: the rank did not import it
    assert os.environ.get("LAZYLOAD_TEST_SETTING") == case, "the rank does not see the test's environment"
    if case == "fails" and rank == 1:
        raise ValueError("case failing on rank 1")


def test_ranks_fork_from_a_single_threaded_preloaded_server_in_the_tests_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYLOAD_TEST_SETTING", "set by the test")
    spawn_cases(2, ["set by the test"], tmp_path, _check_rank)


def test_a_failing_case_names_its_rank_case_and_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYLOAD_TEST_SETTING", "fails")
    with pytest.raises(pytest.fail.Exception) as failed:
        spawn_cases(2, ["fails"], tmp_path, _check_rank)
    message = str(failed.value)
    assert "rank 1, case 'fails'" in message and "ValueError: case failing on rank 1" in message, message
