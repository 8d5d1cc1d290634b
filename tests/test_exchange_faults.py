"""Faults of replicas that exchange what they read (issue 30), on a real gloo job of world
4 with a ("dp", "tp") mesh of (2, 2): one rank (rank 2: dp 1, tp 0, not the store's host)
passes `cooperative=False`, loads a copy of the checkpoint storing one tensor in bf16,
passes a mesh whose dims are named ("tp", "dp"), keeps one Linear of its model in bf16,
passes a 1-D mesh, or raises inside the exchange and stays alive. Every rank ends with a
LazyLoadError (a RankFailedError naming rank 2 and what differs, or rank 2's own error),
none succeeds, no model is made runnable, and none hangs: each job runs under a hard
deadline, and a job that misses it fails with every rank's log.

A rank that dies inside the exchange has a job of its own (nothing runs after it)."""
from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
import traceback

import pytest
import torch

from checkpoints import build_model, model_snapshot, shard_files, write_checkpoint
from gloo import CONTEXT, start_ranks

WORLD, FAULTY, TIMEOUT = 4, 2, 10.0
DEADLINE = 420  # seconds for a whole job (spawning 4 ranks on 2 cores is most of it): past it, a rank hangs
# first a load that works (every rank imports and warms up in it, under a long timeout)
CASES = ("normal", "not-cooperative", "bf16-copy", "dims-swapped", "bf16-linear", "one-dim-mesh", "raises-in-exchange")
# what every rank's RankFailedError says differs, by case
DIFFERS = {"not-cooperative": "its cooperative is False", "bf16-copy": "its checkpoint of tp rank 0",
           "dims-swapped": "its mesh dims is ['tp', 'dp']", "bf16-linear": "its plan.",
           "one-dim-mesh": "its mesh shape is [4]"}
BF16_KEY = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The llama checkpoint, and a copy of it that stores BF16_KEY in bf16."""
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("exchange-faults")
    directory, _ = write_checkpoint("llama", torch.float32, base / "llama")
    copy = base / "bf16-copy"
    shutil.copytree(directory, copy)
    for path in shard_files(copy):
        tensors = load_file(path)
        if BF16_KEY in tensors:
            tensors[BF16_KEY] = tensors[BF16_KEY].to(torch.bfloat16)
            save_file(tensors, path, metadata={"format": "pt"})
    return str(directory), str(copy)


class Log:
    """A rank's progress, line by line in its own file: what a hung job's failure shows."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)

    def __call__(self, *words):
        self.file.write(f"{time.strftime('%H:%M:%S')} " + " ".join(map(str, words)) + "\n")


def _load(case, rank, directory, copy, meshes):
    """Rank `rank`'s load of `case`: rank FAULTY loads otherwise. Returns (model, its
    snapshot before the load, its LoadReport or the error raised)."""
    from lazyload import LazyCheckpoint
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    model = build_model("llama", config, torch.float32)
    faulty = rank == FAULTY
    kwargs = {"mesh": meshes["dp-tp"]}
    if faulty and case == "not-cooperative":
        kwargs["cooperative"] = False
    if faulty and case in ("dims-swapped", "one-dim-mesh"):
        kwargs["mesh"] = meshes[case]
    if faulty and case == "bf16-linear":
        model.model.layers[1].mlp.down_proj.to(torch.bfloat16)
    source = copy if faulty and case == "bf16-copy" else directory
    before = model_snapshot(model)
    try:
        report = LazyCheckpoint(source).load_into(model, progress=False,
                                                  rank_timeout=120 if case == "normal" else TIMEOUT, **kwargs)
    except Exception as exc:  # the outcome under test
        return model, before, exc
    return model, before, report


def _check(case, rank, model, before, exc):
    """Every rank failed with a LazyLoadError saying why, and no model was made runnable
    (the "normal" case: every rank loaded, and received part of its share from its replica)."""
    from lazyload import LazyLoadError, LoadReport, RankFailedError
    from lazyload.errors import ExchangeError

    if case == "normal":
        assert isinstance(exc, LoadReport) and exc.ok and exc.bytes_received > 0, f"rank {rank}: {exc!r}"
        return
    assert not isinstance(exc, LoadReport), f"rank {rank}: the load succeeded though rank {FAULTY} loads otherwise"
    assert isinstance(exc, LazyLoadError), f"rank {rank}: not a LazyLoadError: {exc!r}"
    assert model_snapshot(model) == before, f"rank {rank}: the failed load left its model changed (made runnable)"
    if case == "raises-in-exchange" and rank == FAULTY:
        assert isinstance(exc, ExchangeError) and "injected" in str(exc), repr(exc)
        return
    assert isinstance(exc, RankFailedError) and list(exc.ranks) == [FAULTY], repr(exc)
    if case == "dies-in-exchange":
        assert f"rank {FAULTY}: did not report" in str(exc) and "'exchanged'" in str(exc), str(exc)
    elif case == "raises-in-exchange":
        assert "ExchangeError" in str(exc) and "injected" in str(exc) and "'exchanged'" in str(exc), str(exc)
    else:
        assert DIFFERS[case] in str(exc) and "'planned'" in str(exc), str(exc)


def _break_exchange(after: int, die: bool):
    """The exchange's `after`-th wait for its collectives on this rank raises instead (or
    the process dies there), its peers' collectives in flight."""
    import lazyload.cooperate as cooperate

    original, count = cooperate.wait_all, itertools.count(1)

    def wait_all(*args, **kwargs):
        if next(count) == after:
            if die:
                os._exit(17)
            raise RuntimeError("injected failure in the exchange")
        return original(*args, **kwargs)

    cooperate.wait_all = wait_all


def _worker(rank, world, init_file, directory, copy, logs, cases, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    log = Log(os.path.join(logs, f"rank{rank}.log"))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # every rank makes every mesh (a mesh's groups are made by all ranks): rank FAULTY passes another
    meshes = {"dp-tp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
              "dims-swapped": init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")),
              "one-dim-mesh": init_device_mesh("cpu", (world,))}
    for case in cases:
        log("case", case)
        try:
            if rank == FAULTY and case in ("raises-in-exchange", "dies-in-exchange"):
                _break_exchange(2, die=case == "dies-in-exchange")
            started = time.monotonic()
            model, before, exc = _load(case, rank, directory, copy, meshes)
            seconds = time.monotonic() - started
            log("ended", f"{seconds:.1f} s", repr(exc)[:2000])
            _check(case, rank, model, before, exc)
            results.put((rank, case, None, seconds))
        except BaseException:
            log("FAILED", traceback.format_exc())
            results.put((rank, case, traceback.format_exc(), None))
    log("done")
    sys.stdout.flush()
    # no destroy_process_group: broadcasts that a failed exchange left pending would hold it
    os._exit(0)


def _spawn(cases, tmp_path, checkpoints) -> dict:
    """Run `cases` on a gloo job of WORLD ranks under DEADLINE; (rank, case) -> seconds."""
    logs = tmp_path / "logs"
    logs.mkdir()
    results = CONTEXT.SimpleQueue()
    procs = start_ranks(_worker, (WORLD, str(tmp_path / "pg"), *checkpoints, str(logs), cases, results), WORLD)
    deadline = time.monotonic() + DEADLINE
    try:
        while not all(not p.is_alive() for p in procs.processes):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD}-rank job did not end within {DEADLINE} s (a rank hangs):\n" + _logs(logs))
            time.sleep(0.5)
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    outcomes = {}
    while not results.empty():
        rank, case, failure, seconds = results.get()
        assert failure is None, f"rank {rank}, case {case}:\n{failure}\n" + _logs(logs)
        outcomes[rank, case] = seconds
    return outcomes


def _logs(logs) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(logs.iterdir()))


def test_every_rank_fails_clearly_when_a_replica_loads_otherwise(checkpoints, tmp_path):
    outcomes = _spawn(CASES, tmp_path, checkpoints)
    assert set(outcomes) == {(r, c) for r in range(WORLD) for c in CASES}
    print({case: max(outcomes[r, case] for r in range(WORLD)) for case in CASES})  # seconds to the error


def test_a_rank_dying_in_the_exchange_fails_every_other_rank(checkpoints, tmp_path):
    """Rank FAULTY exits at its second wait in the exchange: the others raise RankFailedError naming it."""
    outcomes = _spawn(("normal", "dies-in-exchange"), tmp_path, checkpoints)
    assert {case for _, case in outcomes} == {"normal", "dies-in-exchange"}
    assert {r for r, case in outcomes if case == "dies-in-exchange"} == set(range(WORLD)) - {FAULTY}
    print({r: seconds for (r, case), seconds in outcomes.items() if case != "normal"})  # seconds to the error
