"""TP workers that read a checkpoint from a URL fetch a row-parallel tensor once between them
(lazyload/integrations/tp_share.py): on a real gloo job of 2 ranks against a local HTTP
range server, each rank's weight loaders record vLLM's boxes (row-parallel: the column half
of every row; column-parallel: half the rows), each rank fetches about half of each
row-parallel tensor in a handful of GETs under the default merge gap, and both get exact
values. Then rank 1 dies in the middle of the exchange: rank 0 raises a LazyLoadError
within rank_timeout instead of hanging."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gloo import spawn_collecting
from remote_servers import RangeServer

TIMEOUT = 5.0
ROW = "model.layers.{}.self_attn.o_proj.weight"  # row-parallel: each rank copies half of every row
COL = "model.layers.{}.self_attn.q_proj.weight"  # column-parallel: half the rows, one range already
LAYERS = 3


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        out[ROW.format(layer)] = torch.randn(96, 512, generator=g).to(torch.bfloat16 if layer == 1 else torch.float32)
        out[COL.format(layer)] = torch.randn(128, 64, generator=g)
    return out


def _load(rank: int, world: int, url: str, expected: list | None = None):
    """Rank `rank`'s copies as vLLM's loaders make them, read with the TP workers sharing:
    deferred (a load), or each as it is made, the `expected` boxes announced (a reload)."""
    from lazyload.integrations.reads import BoxReads, ReadOptions
    from lazyload.integrations.tp_share import Peers
    from lazyload.stored import StoredCheckpoint

    reads = BoxReads(StoredCheckpoint(url), ReadOptions(), world, deferred=expected is None)
    reads.peers = Peers(dist.new_group(backend="gloo"), rank, world, TIMEOUT)
    if expected is not None:
        reads.expect(expected)
    dsts = {}
    for layer in range(LAYERS):
        row = dsts[ROW.format(layer)] = torch.empty(96, 256)  # bf16 layer 1 cast to float32 on arrival
        row.copy_(reads.tensor(ROW.format(layer)).narrow(1, 256 * rank, 256))
        col = dsts[COL.format(layer)] = torch.empty(64, 64)
        col.copy_(reads.tensor(COL.format(layer)).narrow(0, 64 * rank, 64))
    return reads, dsts


def _shares(rank: int, world: int, url: str) -> None:
    load, loaded = _load(rank, world, url)
    load.run()
    for reads, dsts in [(load, loaded), _load(rank, world, url, sorted(load.asked))]:  # the load, then a reload
        _check_shared(rank, reads, dsts)


def _check_shared(rank: int, reads, dsts) -> None:
    want = tensors()
    for layer in range(LAYERS):
        assert torch.equal(dsts[ROW.format(layer)], want[ROW.format(layer)][:, 256 * rank:256 * (rank + 1)].float())
        assert torch.equal(dsts[COL.format(layer)], want[COL.format(layer)][64 * rank:64 * (rank + 1)])
    row_bytes = sum(want[ROW.format(layer)].nbytes for layer in range(LAYERS))
    col_bytes = sum(want[COL.format(layer)].nbytes for layer in range(LAYERS))
    totals, fields = reads.totals, reads.totals.fields
    assert totals.bytes_read == fields["bytes_served"] == row_bytes // 2 + col_bytes // 2  # half rows each: exact
    assert totals.bytes_planned == row_bytes // 2 + col_bytes // 2  # its boxes, in stored bytes
    assert totals.bytes_received == row_bytes // 4  # the half of its boxes the other rank fetched
    assert fields["requests"] <= 2 * LAYERS, fields  # a range per tensor, not a GET per half row


def _mixed_dtypes(rank: int, world: int, url: str) -> None:
    """One layer's exchange of a bfloat16 tensor whose parts have an odd number of elements,
    then a float32 one: each part lands at its place whatever its offset in the message."""
    from lazyload.integrations.tp_share import Peers, exchange, plan_shared, within

    g = torch.Generator().manual_seed(1)
    stored = {"model.layers.0.a": torch.randn(5, 6, generator=g).to(torch.bfloat16),
              "model.layers.0.b": torch.randn(4, 6, generator=g)}
    boxes = [[(name, ((0, t.shape[0]), (3 * r, 3 * r + 3))) for name, t in stored.items()] for r in range(world)]
    layer = list(plan_shared(boxes, lambda name: stored[name].shape).values())
    fetched = {t.name: stored[t.name][within(t.fetch[rank], ((0, len(stored[t.name])), (0, 6)))] for t in layer}
    got = {name: torch.zeros(t.shape[0], 3, dtype=t.dtype) for name, t in stored.items()}

    def deliver(name, box, part, values):
        got[name][within(part, box)] = values

    peers = Peers(dist.new_group(backend="gloo"), rank, world, TIMEOUT)
    received = exchange(peers, layer, fetched, lambda name: stored[name].dtype, deliver)
    for name, t in stored.items():
        assert torch.equal(got[name], t[:, 3 * rank:3 * rank + 3]), name
    assert received == (3 * 3 * 2 + 2 * 3 * 4 if rank == 0 else 2 * 3 * 2 + 2 * 3 * 4)  # rows 0-1 / 0-2 fetched


def _other_layers(rank: int, world: int, url: str) -> None:
    """Workers whose copies came in different orders reach different layers of the same
    sizes at one exchange: an ExchangeError on both, not values of the wrong layer."""
    import lazyload
    from lazyload.integrations.tp_share import Peers, exchange, plan_shared

    stored = {f"model.layers.{k}.w": torch.full((2, 4), float(k)) for k in range(2)}
    boxes = [[(name, ((0, 2), (2 * r, 2 * r + 2))) for name in stored] for r in range(world)]
    shared = plan_shared(boxes, lambda name: stored[name].shape)
    mine = shared[f"model.layers.{rank}.w"]  # rank 0 at layer 0, rank 1 at layer 1
    fetched = {mine.name: stored[mine.name][rank:rank + 1]}
    peers = Peers(dist.new_group(backend="gloo"), rank, world, TIMEOUT)
    with pytest.raises(lazyload.ExchangeError, match=f"TP rank {1 - rank} sent another layer than 'model.layers.{rank}'"):
        exchange(peers, [mine], fetched, lambda name: torch.float32, lambda *args: None)


def _dies(rank: int, world: int, url: str) -> None:
    import lazyload
    import lazyload.integrations.reads as reads_module

    reads, _ = _load(rank, world, url)
    if rank == 1:
        exchange, calls = reads_module.exchange, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os._exit(0)  # gone in the middle of the exchange, no error, no goodbye
            return exchange(*args, **kwargs)
        reads_module.exchange = dying
    with pytest.raises(lazyload.LazyLoadError, match="TP rank 0: the exchange of layer 'model.layers.1' .*(within 5 s|failed)"):
        reads.run()


def _worker(rank, world, init_file, url, errors):
    from gloo import end_rank

    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for case in (_shares, _mixed_dtypes, _other_layers, _dies):
        try:
            case(rank, world, url)
            if case is not _dies:
                dist.barrier()
        except Exception:
            errors.put((rank, case.__name__, traceback.format_exc()))
            raise
    end_rank()


def test_tp_workers_fetch_row_parallel_tensors_once_and_share(tmp_path):
    (tmp_path / "ckpt").mkdir()
    save_file(tensors(), tmp_path / "ckpt" / "model.safetensors")
    with RangeServer(str(tmp_path)) as server:
        spawn_collecting(_worker, (2, str(tmp_path / "pg"), server.url + "/ckpt/model.safetensors"), 2, timeout=300)
