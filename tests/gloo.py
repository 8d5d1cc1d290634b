"""Spawned gloo jobs for the tests: one process group per world (spawning is the expensive
part on 2 cores) running every case on every rank; a case that fails raises in its rank,
and the test fails with each failing rank's traceback."""
from __future__ import annotations

import os
import traceback
from typing import Callable

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
    try:
        for case in cases:
            try:
                run_case(case, rank, world)
                dist.barrier()
            except Exception:
                errors.put((rank, repr(case), traceback.format_exc()))
                raise
    finally:
        dist.destroy_process_group()


def spawn_cases(world: int, cases: list, tmp_path, run_case: Callable) -> None:
    """Run `run_case(case, rank, world)` (a module-level function) for every case on every
    rank of a fresh gloo job of `world` processes."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_worker, args=(world, str(tmp_path / "pg"), run_case, cases, errors), nprocs=world, join=True)
    except Exception:
        failures = []
        while not errors.empty():
            failures.append("rank {}, case {}:\n{}".format(*errors.get()))
        pytest.fail("\n".join(failures) or "a rank failed")
