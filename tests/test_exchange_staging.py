"""The replicas' exchange (cooperate.exchange) over a real gloo group of 2 ranks: a destination
that is not contiguous goes through contiguous staging copies, which count against the host
budget: the most staging bytes held at once stays within it, at budgets below one tensor, one
row and one layer, and every destination ends bit for bit as its reader wrote it. A (dp 2)
load at the smallest budget the plan allows equals world 1's bit for bit."""
from __future__ import annotations

import torch

from checkpoints import build_model, read_header, shard_files, write_checkpoint
from gloo import spawn_cases

BUDGETS = (20, 40, 1000)  # under a row (32 bytes) of the transposed tensor, under it, above it all


def _dests(rank: int):
    """Destination "a" (not contiguous: a transposed 8 x 6 float32) read by rank 0, "b" (4 x 4)
    by rank 1; each rank holds what it read, zeros elsewhere."""
    from lazyload.placer import TensorDest

    want = {"a": torch.arange(48, dtype=torch.float32).reshape(8, 6).t(),
            "b": torch.arange(16, dtype=torch.float32).reshape(4, 4) + 100}
    held = {"a": torch.zeros(8, 6).t(), "b": torch.zeros(4, 4)}
    held["a" if rank == 0 else "b"].copy_(want["a" if rank == 0 else "b"])
    return want, {name: TensorDest(tensor) for name, tensor in held.items()}


def _groups():
    """One layer with one read item per target (what the exchange walks: targets by layer)."""
    from lazyload.headers import TensorEntry
    from lazyload.plan import ReadItem
    from lazyload.schedule import Group

    items = []
    for name, shape in (("a", (6, 8)), ("b", (4, 4))):
        entry = TensorEntry("model.safetensors", name, torch.float32, shape, 0, 4 * shape[0] * shape[1])
        box = tuple((0, n) for n in shape)
        items.append(ReadItem(entry, box, (), name, box))
    return [Group("0", tuple(items))]


def _case(budget, rank, world):
    from lazyload.cooperate import Circle, Share, exchange

    want, dests = _dests(rank)
    received, peak = exchange(_groups(), Share({"a": 0, "b": 1}, Circle(None, rank)), dests, budget)
    assert received == (64 if rank == 0 else 192), f"rank {rank}: received {received}"
    assert 0 < peak <= budget, f"rank {rank}: staged {peak} bytes at once, over the budget of {budget}"
    for name, dest in dests.items():
        assert torch.equal(dest.tensor, want[name]), f"rank {rank}: {name} differs at budget {budget}"


def _case_small_budget(directory, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from lazyload import LazyCheckpoint

    config = AutoConfig.from_pretrained(directory)
    # the smallest budget the plan allows: the largest single read (a whole tensor at tp 1)
    largest = max(end - start for path in shard_files(directory) for key, meta in read_header(path)[1].items()
                  if key != "__metadata__" for start, end in [meta["data_offsets"]])
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    models = []
    for kwargs in ({}, {"mesh": mesh, "max_host_bytes": largest}):
        model = build_model("llama", config, torch.float32)
        report = LazyCheckpoint(directory).load_into(model, progress=False, **kwargs)
        assert report.ok and (report.bytes_received > 0) == ("mesh" in kwargs)
        models.append(dict(model.named_parameters()))
    for name, param in models[0].items():
        assert torch.equal(models[1][name], param), f"rank {rank}: {name} differs at max_host_bytes={largest}"


def _run(case, rank, world):
    if isinstance(case, int):
        _case(case, rank, world)
    else:
        _case_small_budget(case, rank)


def test_exchange_staging_within_budget(tmp_path):
    directory, _ = write_checkpoint("llama", torch.float32, tmp_path / "llama")
    spawn_cases(2, [*BUDGETS, str(directory)], tmp_path, _run)
