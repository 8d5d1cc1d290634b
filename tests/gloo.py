"""Spawned gloo jobs for the tests: one process group per world (spawning is the expensive
part on 2 cores) running every case on every rank; a case that fails raises in its rank,
and the test fails with each failing rank's traceback.

A rank that succeeded ends with `end_rank()`: destroy_process_group, then os._exit, without
interpreter teardown. torch keeps the gloo process group, and its worker threads, alive past
destroy_process_group (torch.distributed.nn's functions take `group.WORLD` as a default
argument when torch._dynamo imports them after init_process_group; DTensor's redistribute
planner cache holds the device mesh and its groups), and gloo threads alive during interpreter
teardown occasionally abort the process ("terminate called without an active exception")
after it reported success.

Every rank is a fork of one forkserver process that imported torch, transformers and lazyload
once per session (FORKSERVER_PRELOAD): a rank starts in a fraction of a second instead of
importing them itself (several seconds each on 2 cores). The server only imports: it runs no
torch op and starts no thread before it forks (no OpenMP pool, no gloo group; each rank makes
its process group after the fork), and each rank takes the test's environment as it is at
start (os.environ, sys.path and the working directory), as a spawned one would.

A job leaves no process behind. Each rank leads a process group of its own and stops what it
started when it ends (`end_rank`: megatron-core's save starts a multiprocessing Manager in
every rank, which os._exit would leave running, orphaned, for ever); after the job the test
kills whatever is left in the ranks' groups, whatever way they ended, and a job that succeeded
but left a process fails, naming it."""
from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, NoReturn

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# What every rank imports, imported once by the forkserver (a module that fails to import is
# skipped there, and the rank imports it itself); this module and checkpoints.py are found on
# the server's sys.path (the test's, tests/ included). Not deepspeed: its import starts threads.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "safetensors.torch", "transformers",
                      "transformers.modeling_utils", *(f"transformers.models.{arch}.modeling_{arch}"
                                                       for arch in ("llama", "qwen2", "mixtral")),
                      "lazyload", "pytest", "checkpoints", "gloo"]
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(FORKSERVER_PRELOAD)


def start_forkserver() -> None:
    """Start the forkserver now, in the background (conftest.py does at the first test, so that
    its imports overlap the tests before the first job); the first job would otherwise."""
    multiprocessing.forkserver.ensure_running()


def start_ranks(worker: Callable, args: tuple, nprocs: int) -> mp.ProcessContext:
    """`mp.start_processes(worker, args, nprocs, join=False)`, each rank a fork of the
    forkserver, in the environment the test has now."""
    return mp.start_processes(_rank_in_environment, args=(dict(os.environ), worker, *args), nprocs=nprocs,
                              join=False, start_method="forkserver")


def call_in_environment(environ: dict, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` with os.environ set to `environ`: a process forked from the
    forkserver has the environment of the server's start, not the test's (a fixture may have
    set credentials or an endpoint since)."""
    os.environ.clear()
    os.environ.update(environ)
    return fn(*args, **kwargs)


def _rank_in_environment(rank: int, environ: dict, worker: Callable, *args) -> None:
    call_in_environment(environ, worker, rank, *args)


def _worker(rank, world, init_file, run_case, cases, errors):
    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for case in cases:
        try:
            run_case(case, rank, world)
            dist.barrier()
        except Exception:
            errors.put((rank, repr(case), traceback.format_exc()))
            dist.destroy_process_group()
            raise
    end_rank()


def end_rank() -> NoReturn:
    """The end of a rank that succeeded: destroy the process group, then exit 0 at once
    (os._exit), so that no interpreter teardown runs beside gloo threads that torch kept, after
    stopping the processes the rank started (os._exit runs no multiprocessing finalizer)."""
    _stop(psutil.Process().children(recursive=True))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_cases(world: int, cases: list, tmp_path, run_case: Callable, timeout: float | None = None) -> None:
    """Run `run_case(case, rank, world)` (a module-level function) for every case on every
    rank of a fresh gloo job of `world` processes."""
    spawn_collecting(_worker, (world, str(tmp_path / "pg"), run_case, cases), world, timeout)


# Seconds a spawned job or a launched command may run before the test fails with the ranks'
# stacks and output instead of hanging the suite (generous: 2 shared cores are slow).
JOB_TIMEOUT = float(os.environ.get("LAZYLOAD_TEST_JOB_TIMEOUT", 900))


def _traced(rank: int, stacks: str, worker: Callable, *args) -> None:
    """A rank that prints every thread's stack to its file in `stacks` on SIGUSR1 (a hung job's
    ranks are asked for theirs before they are killed), then runs `worker(rank, *args)`, in a
    process group of its own (what the rank starts is in it, found after the rank is gone)."""
    os.setpgid(0, 0)
    out = open(os.path.join(stacks, f"rank{rank}.txt"), "w")  # noqa: SIM115 (held for the process's life)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    worker(rank, *args)


def spawn_collecting(worker: Callable, args: tuple, nprocs: int, timeout: float | None = None) -> None:
    """`start_ranks(worker, args + (errors,), nprocs)`, where a failing rank puts (rank, ..., traceback)
    on `errors`; the test then fails with every failing rank's traceback. A job still running
    after `timeout` seconds (default JOB_TIMEOUT) fails with each rank's stacks, then is killed."""
    timeout = JOB_TIMEOUT if timeout is None else timeout
    errors = CONTEXT.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="lazyload-stacks-") as stacks:
        job = start_ranks(_traced, (stacks, worker, *args, errors), nprocs)
        deadline = time.monotonic() + timeout
        try:
            while not job.join(timeout=1):
                if time.monotonic() > deadline:
                    pytest.fail(f"{nprocs} ranks still running after {timeout:.0f} s (a hang); their stacks:\n"
                                + _stacks_of(job.processes, stacks))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            failures = []
            while not errors.empty():
                rank, *what, tb = errors.get()
                failures.append(f"rank {rank}" + "".join(f", case {w}" for w in what) + f":\n{tb}")
            pytest.fail("\n".join(failures) or f"a rank failed: {exc}")
        finally:
            for process in job.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
            left = [p for process in job.processes for p in _group(process.pid)]
            named = [f"{p.pid} {_cmdline(p)[:200]}" for p in left]
            _stop(left)
    if left:
        pytest.fail(f"the job's ranks ended but left {len(left)} process(es) running (killed now): " + "; ".join(named))


def _group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid` (a rank's, and what it started)."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.Error):  # ended since listed
            pass
    return members


def _stop(processes: list[psutil.Process]) -> None:
    """Kill `processes` and wait until they are gone."""
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return "(ended)"


def _stacks_of(processes: list, stacks: str) -> str:
    """Every live rank's thread stacks (faulthandler, on SIGUSR1), read from its file."""
    paths = [os.path.join(stacks, f"rank{rank}.txt") for rank in range(len(processes))]
    asked = [path for process, path in zip(processes, paths) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    _wait_written(asked, within=10)
    texts = []
    for rank, (process, path) in enumerate(zip(processes, paths)):
        text = open(path).read() if os.path.exists(path) else ""
        texts.append(f"rank {rank} ({'running' if process.is_alive() else f'exit {process.exitcode}'}):\n"
                     + (text or "(no stack: the rank had not started)"))
    return "\n".join(texts)


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _wait_written(paths: list[str], within: float) -> None:
    """Until every file is non-empty and none grew for 0.2 s (faulthandler writes from the
    signal handler at once; a slow rank takes a moment), or `within` seconds."""
    deadline, sizes = time.monotonic() + within, None
    while time.monotonic() < deadline:
        now = [_size(path) for path in paths]
        if now == sizes and all(now):
            return
        sizes = now
        time.sleep(0.2)


def run_job(cmd: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` for a multi-process command
    (torchrun, an example): past `timeout` seconds (default JOB_TIMEOUT) the whole process group
    is killed and the test fails with what the command printed, instead of hanging the suite."""
    timeout = JOB_TIMEOUT if timeout is None else timeout
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # torchrun's ranks with it: its own session
            out, err = child.communicate()
            pytest.fail(f"{' '.join(map(str, cmd))} still running after {timeout:.0f} s (a hang); its output:\n"
                        f"{out[-6000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)
