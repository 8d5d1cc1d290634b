"""TP workers that read a checkpoint from a URL fetch a row-parallel tensor once between them
(lazyload/integrations/tp_share.py): on a real gloo job of 2 ranks against a local HTTP
range server, each rank's weight loaders record vLLM's boxes (row-parallel: the column half
of every row; column-parallel: half the rows), each rank fetches about half of each
row-parallel tensor in a handful of GETs under the default merge gap, and both get exact
values. Under a small max_host_bytes the exchange runs in rounds whose buffers fit it (at a
reload, beside the layer's values each worker keeps until its copies); with
`cooperative: False` (the loader's config) each rank fetches its own boxes. Then rank 1 dies
in the middle of the exchange (or, in a job of its own, stalls alive before it): rank 0
raises a LazyLoadError within rank_timeout instead of hanging."""
from __future__ import annotations

import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gloo import spawn_collecting
from remote_servers import RangeServer

TIMEOUT = 5.0
STALL_TIMEOUT = 3.0
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


def _load(rank: int, world: int, url: str, expected: list | None = None, extra: dict | None = None):
    """Rank `rank`'s copies as vLLM's loaders make them, read with the TP workers sharing as
    the loader's `model_loader_extra_config` `extra` says (`vllm.tp_peers`): deferred (a
    load), or each as it is made, the `expected` boxes announced (a reload)."""
    from lazyload.integrations.reads import BoxReads
    from lazyload.integrations.vllm import LoaderConfig, tp_peers
    from lazyload.stored import StoredCheckpoint

    config = LoaderConfig.of({"rank_timeout": TIMEOUT, **(extra or {})})
    checkpoint = StoredCheckpoint(url)
    reads = BoxReads(checkpoint, config.read, world, deferred=expected is None)
    reads.peers = tp_peers(config, checkpoint, world, dist.new_group(backend="gloo"))
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
    for reads, dsts in _load_and_reload(rank, world, url):
        _check_shared(rank, reads, dsts)
        assert reads.totals.fields["requests"] <= 2 * LAYERS, reads.totals.fields  # a range a tensor, not a half row


def _load_and_reload(rank: int, world: int, url: str, extra: dict | None = None) -> list:
    """[(the load's reads, its destinations), the reload's]: the reload expects the load's boxes."""
    load, loaded = _load(rank, world, url, extra=extra)
    load.run()
    return [(load, loaded), _load(rank, world, url, sorted(load.asked), extra)]


def _check_values(rank: int, dsts) -> None:
    want = tensors()
    for layer in range(LAYERS):
        assert torch.equal(dsts[ROW.format(layer)], want[ROW.format(layer)][:, 256 * rank:256 * (rank + 1)].float())
        assert torch.equal(dsts[COL.format(layer)], want[COL.format(layer)][64 * rank:64 * (rank + 1)])


def _check_shared(rank: int, reads, dsts) -> None:
    _check_values(rank, dsts)
    want = tensors()
    row_bytes = sum(want[ROW.format(layer)].nbytes for layer in range(LAYERS))
    col_bytes = sum(want[COL.format(layer)].nbytes for layer in range(LAYERS))
    totals, fields = reads.totals, reads.totals.fields
    assert totals.bytes_read == fields["bytes_served"] == row_bytes // 2 + col_bytes // 2  # half rows each: exact
    assert totals.bytes_planned == row_bytes // 2 + col_bytes // 2  # its boxes, in stored bytes
    assert totals.bytes_received == row_bytes // 4  # the half of its boxes the other rank fetched


BUDGET = 40_000  # a float32 row-parallel tensor's buffers take 192 KiB per rank in one round (fetch, send, receive)
RELOAD_BUDGET = 150_000  # a reload also keeps a layer's values: 96 KiB per rank of a float32 layer


def _within_budget(rank: int, world: int, url: str) -> None:
    """Under a small max_host_bytes each layer is exchanged in several rounds, each tensor cut
    by rows, and what one round holds stays within it: its buffers, and at a reload this
    worker's box of the layer's row-parallel tensor, kept whole from the layer's first round
    until its copy (counted in the peak); values and bytes as in one round."""
    import lazyload.integrations.reads as reads_module

    exchange, rounds = reads_module.exchange, []

    def counted(*args, **kwargs):
        received, buffers = exchange(*args, **kwargs)
        rounds.append((args[1], buffers))
        return received, buffers
    reads_module.exchange = counted
    try:
        load, loaded = _load(rank, world, url, extra={"max_host_bytes": BUDGET})
        load.run()
        _check_shared(rank, load, loaded)
        at_load, rounds = rounds, []
        reload, reloaded = _load(rank, world, url, sorted(load.asked), {"max_host_bytes": RELOAD_BUDGET})
        _check_shared(rank, reload, reloaded)
    finally:
        reads_module.exchange = exchange
    assert 0 < load.totals.exchange_peak_bytes == max(buffers for _, buffers in at_load) <= BUDGET
    want = tensors()
    peak = max(buffers + want[ts[0].name][:, :256].nbytes for ts, buffers in rounds)  # its box: half the columns
    assert reload.totals.exchange_peak_bytes == peak <= RELOAD_BUDGET, (reload.totals.exchange_peak_bytes, peak)
    assert min(len(at_load), len(rounds)) >= 2 * LAYERS, (len(at_load), len(rounds))  # more than a round per layer
    assert all(len(ts) == 1 for ts, _ in at_load + rounds)  # every row-parallel tensor cut (one per layer here)


def _reload_budget_below_its_values(rank: int, world: int, url: str) -> None:
    """A max_host_bytes that holds the load's rounds but not, at a reload, a layer's values
    beside one row's exchange is a PlanError on every worker before any fetch."""
    import lazyload

    load, _ = _load(rank, world, url, extra={"max_host_bytes": BUDGET})
    load.run()
    with pytest.raises(lazyload.PlanError, match=r"max_host_bytes=40000 cannot hold, at a reload, a TP worker's "
                                                 r"values of the row-parallel tensors of layer 'model.layers.0' up "
                                                 r"to model.layers.0.self_attn.o_proj.weight \(98304 bytes"):
        _load(rank, world, url, sorted(load.asked), {"max_host_bytes": BUDGET})


def _budget_below_a_row(rank: int, world: int, url: str) -> None:
    """A max_host_bytes below one row's exchange is a PlanError on every worker before any fetch."""
    import lazyload

    reads, _ = _load(rank, world, url, extra={"max_host_bytes": 3000})  # a row: 2 KiB fetched, 1 KiB sent and received
    with pytest.raises(lazyload.PlanError, match="max_host_bytes=3000 is smaller than the TP workers' exchange of one "
                                                 r"row of model.layers.0.self_attn.o_proj.weight \(4112 bytes"):
        reads.run()
    assert reads.totals.bytes_read == 0


def _not_cooperative(rank: int, world: int, url: str) -> None:
    """With `cooperative: False` each worker fetches its own boxes: nothing exchanged."""
    for reads, dsts in _load_and_reload(rank, world, url, {"cooperative": False}):
        assert reads.peers is None
        _check_values(rank, dsts)
        assert reads.totals.bytes_received == reads.totals.exchange_peak_bytes == 0
        assert reads.totals.bytes_read >= reads.totals.bytes_planned  # its own half rows (merged: more)


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
    received, _ = exchange(peers, layer, fetched, lambda name: stored[name].dtype, deliver)
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


def _stalls(rank: int, world: int, url: str) -> None:
    """Rank 1 stays alive but never reaches its exchange of layer 1: rank 0 raises within
    rank_timeout (short here), then ends rank 1 (SIGTERM: it exits 0, as the job wants)."""
    import lazyload
    import lazyload.integrations.reads as reads_module

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    reads, _ = _load(rank, world, url, extra={"rank_timeout": STALL_TIMEOUT})
    if rank == 1:
        exchange, calls = reads_module.exchange, []
        signal.signal(signal.SIGTERM, lambda *args: os._exit(0))

        def stalling(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                while True:
                    time.sleep(60)  # stuck: alive, but never at the collective
            return exchange(*args, **kwargs)
        reads_module.exchange = stalling
        reads.run()
    with pytest.raises(lazyload.LazyLoadError, match=f"TP rank 0: the exchange of layer 'model.layers.1' .*did not "
                                                     f"finish within {STALL_TIMEOUT:g} s"):
        reads.run()
    os.kill(pids[1], signal.SIGTERM)


def _worker(rank, world, init_file, url, cases, errors):
    from gloo import end_rank

    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for case in cases:
        try:
            case(rank, world, url)
            if case not in (_dies, _stalls):
                dist.barrier()
        except Exception:
            errors.put((rank, case.__name__, traceback.format_exc()))
            raise
    end_rank()


def _job(tmp_path, cases: tuple) -> None:
    """`cases` on both ranks of a gloo job reading the checkpoint from a local range server."""
    (tmp_path / "ckpt").mkdir()
    save_file(tensors(), tmp_path / "ckpt" / "model.safetensors")
    with RangeServer(str(tmp_path)) as server:
        spawn_collecting(_worker, (2, str(tmp_path / "pg"), server.url + "/ckpt/model.safetensors", cases), 2,
                         timeout=300)


def test_tp_workers_fetch_row_parallel_tensors_once_and_share(tmp_path):
    _job(tmp_path, (_shares, _within_budget, _budget_below_a_row, _reload_budget_below_its_values, _not_cooperative,
                    _mixed_dtypes, _other_layers, _dies))


def test_a_stalled_tp_worker_is_an_error_on_the_others_not_a_hang(tmp_path):
    _job(tmp_path, (_stalls,))


def _round_bytes(tensor, rank: int, itemsize: int) -> int:
    """What `rank` holds of `tensor` in a round: its fetch, what it sends, what it receives."""
    from lazyload.expr import box_numel
    from lazyload.integrations.tp_share import overlap

    def moved(source, target):
        fetched = tensor.fetch[source]
        return sum(box_numel(o) for box in tensor.boxes[target] if fetched and (o := overlap(fetched, box)))
    others = [o for o in range(len(tensor.fetch)) if o != rank]
    fetch = box_numel(tensor.fetch[rank]) if tensor.fetch[rank] else 0
    return itemsize * (fetch + sum(moved(rank, o) + moved(o, rank) for o in others))


@pytest.mark.parametrize("keep, budgets", [(False, (2_000, 5_000, 20_000)), (True, (7_000, 10_000, 20_000))])
def test_rounds_fit_the_budget_and_cover_every_fetched_row_once(keep, budgets):
    """A layer of tensors of several sizes and dtypes at TP 3: each round's buffers (fetch,
    send, receive, tags) fit the budget on every rank, small tensors share a round, a big one is
    cut, and the rounds fetch each rank's rows of every tensor exactly once, in order. At a
    reload (`keep`) each rank's boxes of the tensors begun so far (kept whole until their
    copies) fit beside each round's buffers too; a budget that cannot hold them beside one
    row's exchange is a PlanError."""
    import lazyload
    from lazyload.integrations.tp_share import TAG, plan_shared, rounds

    world = 3
    shapes = {"model.layers.0.a": (6, 12), "model.layers.0.b": (8, 12), "model.layers.0.c": (300, 12)}
    dtypes = {"model.layers.0.a": torch.float32, "model.layers.0.b": torch.bfloat16, "model.layers.0.c": torch.float32}
    boxes = [[(name, ((0, rows), (4 * r, 4 * r + 4))) for name, (rows, _) in shapes.items()] for r in range(world)]
    layer = list(plan_shared(boxes, shapes.__getitem__).values())
    for budget in budgets:
        out, begun = rounds(layer, world, dtypes.__getitem__, budget, keep), set()
        for tensors in out:
            begun |= {t.name for t in tensors}
            kept = sum(shapes[name][0] * 4 * dtypes[name].itemsize for name in begun) if keep else 0  # a rank's box
            held = [2 * (world - 1) * TAG + kept + sum(_round_bytes(t, rank, dtypes[t.name].itemsize) for t in tensors)
                    for rank in range(world)]
            assert max(held) <= budget, (budget, held)
        assert [t.name for t in out[0]][:2] == ["model.layers.0.a", "model.layers.0.b"]  # small ones in one round
        for whole in layer:
            parts = [t for tensors in out for t in tensors if t.name == whole.name]
            for rank in range(world):
                rows = [p.fetch[rank][0] for p in parts if p.fetch[rank] is not None]
                assert rows[0][0] == whole.fetch[rank][0][0] and rows[-1][1] == whole.fetch[rank][0][1]
                assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous, no row twice
        cuts = len([t for tensors in out for t in tensors if t.name.endswith(".c")])
        assert cuts == 1 if budget == 20_000 else cuts > 2  # c's buffers: 11 kB on a rank (its box: 4.8 kB)
    if keep:  # 5 kB holds the load's rounds, not c's box beside a row of it
        with pytest.raises(lazyload.PlanError, match="max_host_bytes=5000 cannot hold, at a reload, a TP worker's "
                                                     r"values .* up to model.layers.0.c \(4960 bytes"):
            rounds(layer, world, dtypes.__getitem__, 5_000, keep)
