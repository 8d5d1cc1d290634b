"""load_into(model, mesh=...) over a torch DeviceMesh (gloo, CPU, 4 spawned processes):
a 2-D ("dp", "tp") mesh loads a runnable TP model on every replica, whose ranks read only
their part of the shard they share (cooperative reads) and receive the rest from the other
replicas; a 1-D mesh is rank/world. Every rank's tensors are compared bit for bit with the
world-1 load's slices, its logits with world 1's."""
from __future__ import annotations

import contextlib
import itertools
import logging
import re

import pytest
import torch

from checkpoints import build_model, fixed_input, write_checkpoint
from gloo import spawn_cases
from remote_servers import RangeServer

WORLD = 4
# storage bytes of a cooperating rank, at most this fraction of a rank's share, by dp size
AT_MOST = {2: 0.6, 4: 0.35}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory, _ = write_checkpoint("llama", torch.float32, tmp_path_factory.mktemp("mesh") / "llama")
    return str(directory)


@contextlib.contextmanager
def _logged():
    """The records the "lazyload" logger emits (INFO and above) inside the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("lazyload")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _logits(model, config):
    with torch.no_grad():
        return model(input_ids=fixed_input(config)).logits


def _locals(model) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in model.named_parameters()}


def _load(source, config, **kwargs):
    from lazyload import LazyCheckpoint

    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(source).load_into(model, progress=False, **kwargs)
    assert report.ok
    return model, report


def _assert_world1_slices(model, ref, label):
    """Every tensor of `model` is its rank's slice of the world-1 tensor: gathered over
    the tp dim (a DTensor) or whole, bit for bit."""
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        assert torch.equal(full, ref_params[name].detach()), f"{label}: {name} differs from world 1's"


def _case_replicas(directory, source, rank, dp, tp):
    """(dp, tp), from `source` (the directory or its URL): cooperative loads equal world 1's
    slices and the non-cooperative load's local tensors bit for bit, read at most AT_MOST
    of the storage bytes, and receive the rest."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    ref, world1 = _load(directory, config)
    plain, alone = _load(source, config, mesh=mesh, cooperative=False)
    with _logged() as records:
        model, shared = _load(source, config, mesh=mesh)
    slowest = [r.getMessage() for r in records if "slowest" in r.getMessage()]
    assert len(slowest) == (rank == 0), f"rank {rank}: {slowest}"  # rank 0 logs the slowest rank
    assert not slowest or re.search(r"rank \d was the slowest to 'read': [\d.]+ s, [\d.]+ s behind", slowest[0])
    label = f"rank {rank} of (dp {dp}, tp {tp}) from {source}"
    assert (shared.rank, shared.world) == (mesh["tp"].get_local_rank(), tp), label
    _assert_world1_slices(model, ref, label)
    mine, theirs = _locals(model), _locals(plain)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs), f"{label}: local tensors differ"
    own = alone.bytes_read + alone.bytes_mapped
    storage = shared.bytes_read + shared.bytes_mapped
    assert alone.bytes_received == 0 and shared.bytes_received > 0, label
    assert storage <= AT_MOST[dp] * own, f"{label}: {storage} bytes from storage of a share of {own}"
    assert storage + shared.bytes_received >= own, f"{label}: {storage} + {shared.bytes_received} < {own}"
    # every byte of the checkpoint read once in the whole job: norms (held whole by every tp
    # rank) by one rank of the mesh, each shard by one of its replicas
    total = torch.tensor([shared.bytes_read])
    dist.all_reduce(total)
    assert total.item() == world1.bytes_read + world1.bytes_mapped, f"{label}: {total.item()} bytes read in all"
    want = _logits(ref, config)
    for got in (_logits(model, config), _logits(plain, config)):
        if tp == 1:
            assert torch.equal(got, want), label
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label}: {m}")


def _case_quantized(directory, rank):
    """Quantized on load (8-bit data and scales per target) at (dp 2, tp 2): what replicas
    exchange is each destination's tensors, so they equal the non-cooperative load's."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from lazyload import Quantization

    config = AutoConfig.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # whole groups in each rank's columns; lazyload's own holders, whose int8 tensors the state
    # dict shows (torchao's, the default where installed, are made from the same exchanged tensors)
    int8 = Quantization("int8", group_size=16, torchao=False)
    plain, _ = _load(directory, config, mesh=mesh, cooperative=False, quantize=int8)
    model, shared = _load(directory, config, mesh=mesh, quantize=int8)
    assert shared.quantized and shared.bytes_received > 0
    mine, theirs = _states(model), _states(plain)
    assert mine.keys() == theirs.keys() and any(t.dtype == torch.int8 for t in mine.values())
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs), f"rank {rank}: quantized tensors differ"
    torch.testing.assert_close(_logits(model, config), _logits(plain, config), rtol=0, atol=0)


def _case_fsdp_over_dp(directory, rank):
    """A model the user sharded over "dp" (FSDP2): replicas hold different bytes, so they read
    their own (nothing received), and every tensor is world 1's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig
    from lazyload import LazyCheckpoint

    config = AutoConfig.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, _ = _load(directory, config)
    model = build_model("llama", config, torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    report = LazyCheckpoint(directory).load_into(model, mesh=mesh, progress=False)
    assert report.bytes_received == 0, f"rank {rank}: received {report.bytes_received} bytes"
    _assert_world1_slices(model, ref, f"rank {rank}, FSDP over dp")


def _case_mesh_errors(directory, rank):
    """A mesh of other dims, or a rank/world the mesh contradicts: an ArgumentError before
    anything is read, the model untouched."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from lazyload import ArgumentError, LazyCheckpoint

    config = AutoConfig.from_pretrained(directory)
    unnamed = init_device_mesh("cpu", (2, 2))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for kwargs, words in (({"mesh": unnamed}, "('dp', 'tp')"), ({"mesh": named, "rank": 0, "world": 4}, "mesh alone")):
        model = build_model("llama", config, torch.float32)
        with pytest.raises(ArgumentError, match=re.escape(words)):
            LazyCheckpoint(directory).load_into(model, progress=False, **kwargs)
        assert all(p.is_meta for p in model.parameters())


def _states(model) -> dict[str, torch.Tensor]:
    return {n: (t.to_local() if hasattr(t, "to_local") else t) for n, t in model.state_dict().items()}


def _case_one_dim(directory, rank, world):
    """A 1-D mesh is rank/world: the same local tensors, and a runnable model."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    by_mesh, report = _load(directory, config, mesh=init_device_mesh("cpu", (world,)))
    by_rank, _ = _load(directory, config, rank=rank, world=world)
    assert (report.rank, report.world, report.bytes_received) == (rank, world, 0)
    mine, theirs = _locals(by_mesh), _locals(by_rank)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs), f"rank {rank}: 1-D mesh differs from rank/world"
    torch.testing.assert_close(_logits(by_mesh, config), _logits(by_rank, config), rtol=0, atol=0)


def _case_failing_rank(directory, rank, faulty):
    """A rank whose part fails mid-read makes every rank raise; no model is assigned where
    RankFailedError is raised (its parameters stay on meta)."""
    import errno

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from lazyload import RankFailedError, ReadError
    from lazyload.readers import PreadReader

    config = AutoConfig.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    original = PreadReader.read_into

    def failing_read(self, item, out, _count=itertools.count(1)):
        if next(_count) == 2:
            raise OSError(errno.EIO, "injected", item.entry.file)
        return original(self, item, out)

    if rank == faulty:
        PreadReader.read_into = failing_read
    model = build_model("llama", config, torch.float32)
    from lazyload import LazyCheckpoint
    try:
        LazyCheckpoint(directory).load_into(model, mesh=mesh, reader="pread", progress=False, rank_timeout=30)
        raise AssertionError(f"rank {rank}: the load succeeded though rank {faulty} failed")
    except RankFailedError as exc:
        assert rank != faulty and faulty in exc.ranks and exc.ranks[faulty].startswith("ReadError"), str(exc)
        assert all(p.is_meta for p in model.parameters()), f"rank {rank}: assigned although rank {faulty} failed"
    except ReadError:
        assert rank == faulty
    finally:
        PreadReader.read_into = original


def _run_case(case, rank, world):
    name, directory, url = case
    if name == "dp2tp2":
        _case_replicas(directory, directory, rank, 2, 2)
    elif name == "dp4tp1":
        _case_replicas(directory, directory, rank, 4, 1)
    elif name == "http":
        _case_replicas(directory, url, rank, 2, 2)
    elif name == "quantized":
        _case_quantized(directory, rank)
    elif name == "fsdp":
        _case_fsdp_over_dp(directory, rank)
    elif name == "errors":
        _case_mesh_errors(directory, rank)
    elif name == "one_dim":
        _case_one_dim(directory, rank, world)
    elif name == "failing":
        _case_failing_rank(directory, rank, faulty=1)


def test_mesh_loads(llama, tmp_path):
    """Every case on one 4-process job: (dp 2, tp 2) and (dp 4, tp 1) on local files, (dp 2,
    tp 2) over the HTTP test server (ranged GETs), quantized on load, a 1-D mesh, a failing rank."""
    with RangeServer(llama) as server:
        cases = [(name, llama, server.url + "/") for name in ("dp2tp2", "dp4tp1", "http", "quantized", "fsdp",
                                                            "errors", "one_dim", "failing")]
        spawn_cases(WORLD, cases, tmp_path, _run_case)
