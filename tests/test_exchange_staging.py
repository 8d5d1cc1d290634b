"""The replicas' exchange (cooperate.exchange) over a real gloo group of 2 ranks: a destination
that is not contiguous goes through contiguous staging copies, which count against the host
budget: the most staging bytes held at once stays within it, at budgets below one tensor, one
row and one layer, and every destination ends bit for bit as its reader wrote it. A (dp 2)
load at the smallest budget the plan allows equals world 1's bit for bit. A bfloat16
checkpoint loaded into a float32 model on (dp 2) takes at most one broadcast per reader and
layer (not one per tensor), receives the bfloat16 bytes its peer read (not float32), and
equals world 1's bit for bit."""
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


def _case_bf16_into_fp32(directory, rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from lazyload import LazyCheckpoint
    from lazyload.schedule import layer_of

    config = AutoConfig.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    ref = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, progress=False)
    model = build_model("llama", config, torch.float32)
    calls, broadcast = [], dist.broadcast
    dist.broadcast = lambda *args, **kwargs: calls.append(1) or broadcast(*args, **kwargs)
    try:
        report = LazyCheckpoint(directory).load_into(model, mesh=mesh, progress=False)
    finally:
        dist.broadcast = broadcast
    names = [n for n, _ in model.named_parameters()]
    layers = {layer_of(n) for n in names}
    assert len(calls) <= 2 * len(layers) < len(names), f"rank {rank}: {len(calls)} broadcasts for {len(layers)} layers"
    read = torch.tensor([report.bytes_read])
    dist.all_reduce(read)  # the two ranks' reads: each received what the other read, as read (bfloat16)
    assert report.bytes_received == read.item() - report.bytes_read > 0, f"rank {rank}: {report.bytes_received}"
    for name, param in ref.named_parameters():
        assert torch.equal(model.get_parameter(name).view(torch.int32), param.view(torch.int32)), name


def _run(case, rank, world):
    if isinstance(case, int):
        _case(case, rank, world)
    elif case.endswith("bf16"):
        _case_bf16_into_fp32(case, rank)
    else:
        _case_small_budget(case, rank)


def test_exchange_staging_within_budget(tmp_path):
    directory, _ = write_checkpoint("llama", torch.float32, tmp_path / "llama")
    bf16, _ = write_checkpoint("llama", torch.bfloat16, tmp_path / "llama-bf16")
    spawn_cases(2, [*BUDGETS, str(directory), str(bf16)], tmp_path, _run)
