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


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_KEPT = []  # the rank's managers, held as megatron-core holds its results queue


def _starts_a_manager(case, rank, world):
    """As megatron-core's dist_checkpointing.save does: a multiprocessing Manager (a spawned
    server process) held in a global, never shut down."""
    import multiprocessing

    _KEPT.append(multiprocessing.get_context("spawn").Manager())
    with open(os.path.join(case, f"rank{rank}.pid"), "w") as f:
        f.write(str(_KEPT[-1]._process.pid))


def test_a_rank_stops_the_processes_it_started(tmp_path):
    spawn_cases(2, [str(tmp_path)], tmp_path, _starts_a_manager)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    assert not any(_running(pid) for pid in pids), f"the ranks' managers {pids} are still running"


def _leaves_a_process(rank, pid_dir, errors):
    """A rank that starts a process and exits at once, without end_rank."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(child.pid))
    os._exit(0)


def test_a_job_that_leaves_a_process_fails_naming_it_and_the_process_is_killed(tmp_path):
    from gloo import spawn_collecting

    with pytest.raises(pytest.fail.Exception) as failed:
        spawn_collecting(_leaves_a_process, (str(tmp_path),), 2)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    assert "left 2 process(es) running" in str(failed.value) and "sleep 600" in str(failed.value), failed.value
    assert not any(_running(pid) for pid in pids), f"{pids} are still running"
