"""Spawned gloo jobs for the tests: one process group per world (spawning is the expensive
part on 2 cores) running every case on every rank; a case that fails raises in its rank,
and the test fails with each failing rank's traceback.

A rank that succeeded ends with `end_rank()`: destroy_process_group, then os._exit, without
interpreter teardown. torch keeps the gloo process group, and its worker threads, alive past
destroy_process_group (torch.distributed.nn's functions take `group.WORLD` as a default
argument when torch._dynamo imports them after init_process_group; DTensor's redistribute
planner cache holds the device mesh and its groups), and gloo threads alive during interpreter
teardown occasionally abort the process ("terminate called without an active exception")
after it reported success."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, NoReturn

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    (os._exit), so that no interpreter teardown runs beside gloo threads that torch kept."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_cases(world: int, cases: list, tmp_path, run_case: Callable) -> None:
    """Run `run_case(case, rank, world)` (a module-level function) for every case on every
    rank of a fresh gloo job of `world` processes."""
    spawn_collecting(_worker, (world, str(tmp_path / "pg"), run_case, cases), world)


def spawn_collecting(worker: Callable, args: tuple, nprocs: int) -> None:
    """`mp.spawn(worker, args + (errors,))`, where a failing rank puts (rank, ..., traceback)
    on `errors`; the test then fails with every failing rank's traceback."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(worker, args=(*args, errors), nprocs=nprocs, join=True)
    except Exception:
        failures = []
        while not errors.empty():
            rank, *what, tb = errors.get()
            failures.append(f"rank {rank}" + "".join(f", case {w}" for w in what) + f":\n{tb}")
        pytest.fail("\n".join(failures) or "a rank failed")
