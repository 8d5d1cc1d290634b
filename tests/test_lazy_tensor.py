"""Lazy tensors (lazyload/integrations): what an engine's weight loaders are handed. Views
move a box and read nothing; a copy into a real tensor is read box by box, exactly its
bytes; anything else reads the view and counts as a fallback. The vLLM cases themselves
run in tests/in_vllm (a venv of their own)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from lazyload import ArgumentError, PlanError, ShapeMismatchError
from lazyload.integrations.lazy_tensor import LazyTensor
from lazyload.integrations.reads import BoxReads, ReadOptions
from lazyload.integrations.vllm import LoaderConfig
from lazyload.remote import RemoteOptions
from lazyload.stored import StoredCheckpoint

W = torch.arange(6 * 8 * 4, dtype=torch.float32).reshape(6, 8, 4) / 7  # distinct values
B = torch.randn(16, 12, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

# What vLLM's weight loaders do to a checkpoint tensor before copying it (narrow for a TP
# shard, chunk of a fused gate/up, unbind of stacked experts, transposed experts, a dim of
# size 1 added for a single expert), and combinations.
VIEWS = {
    "narrow": lambda t: t.narrow(1, 2, 4),
    "slice": lambda t: t[1:5, 3:],
    "negative slice": lambda t: t[-2:, :-1],
    "select": lambda t: t[3],
    "select then narrow": lambda t: t[2].narrow(0, 4, 4),
    "chunk": lambda t: t.chunk(2, dim=1)[1],
    "split sizes": lambda t: t.split([1, 3, 4], dim=1)[1],
    "unbind": lambda t: t.unbind(0)[4],
    "transpose": lambda t: t.transpose(0, 2)[1:3],
    "permute": lambda t: t.permute(2, 0, 1).narrow(2, 1, 3),
    "t of a select": lambda t: t[1].t(),
    "unsqueeze": lambda t: t[0].unsqueeze(0).narrow(1, 2, 2),
    "squeeze": lambda t: t[2:3].squeeze(0),
    "view adding a dim": lambda t: t[:, 5].view(6, 1, 4),
    "ellipsis": lambda t: t[..., 2],
    "cast": lambda t: t.to(torch.bfloat16)[1],
    "clone and contiguous": lambda t: t[1:3].clone().contiguous(),
}

# Operations no box records: read whole (the view), counted as fallbacks
FALLBACKS = {
    "arithmetic": lambda t: t[1] * 2,
    "strided slice": lambda t: t[:, ::2],
    "a view merging dims": lambda t: t[1:3].reshape(-1),
    "sum": lambda t: t.sum(dim=0),
}


@pytest.fixture
def checkpoint(tmp_path):
    save_file({"model.layers.0.w": W}, tmp_path / "a.safetensors")
    save_file({"model.layers.1.b": B}, tmp_path / "b.safetensors")
    return StoredCheckpoint(tmp_path)


@pytest.mark.parametrize("reader", ["mmap", "pread"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_a_view_reads_exactly_its_box(checkpoint, view, reader):
    reads = BoxReads(checkpoint, ReadOptions(reader=reader))
    lazy = VIEWS[view](reads.tensor("model.layers.0.w"))
    expected = VIEWS[view](W)
    assert isinstance(lazy, LazyTensor) and lazy.shape == expected.shape and lazy.dtype == expected.dtype
    out = torch.full(expected.shape, -1.0, dtype=torch.float64)  # another dtype: cast on arrival
    out.copy_(lazy)
    assert reads.totals.bytes_read == 0 and (out == -1).all()  # recorded, not read
    reads.run()
    assert torch.equal(out, expected.double())
    assert reads.totals.bytes_planned == expected.numel() * 4  # the box's bytes, nothing more
    if reader == "mmap":  # copies exactly the box; pread may read across a gap where one read is cheaper
        assert reads.totals.bytes_read == reads.totals.bytes_planned
    assert reads.totals.bytes_planned <= reads.totals.bytes_read <= W.numel() * 4
    assert reads.totals.fallbacks == []


@pytest.mark.parametrize("op", list(FALLBACKS))
def test_another_operation_reads_the_view_and_counts_a_fallback(checkpoint, op):
    reads = BoxReads(checkpoint, ReadOptions())
    result = FALLBACKS[op](reads.tensor("model.layers.0.w"))
    assert not isinstance(result, LazyTensor)
    assert torch.equal(result, FALLBACKS[op](W))
    assert len(reads.totals.fallbacks) == 1 and reads.totals.fallbacks[0][0] == "model.layers.0.w"


def test_copies_into_parameters_as_vllm_loaders_make_them(checkpoint):
    """`param.data.copy_`, a narrowed destination, several copies into one parameter (fused
    QKV), copies in two layers read in one run; a copy on meta (vLLM's reload counts copies
    there first) reads nothing."""
    reads = BoxReads(checkpoint, ReadOptions(max_host_bytes=192))  # the largest box: one read at a time)
    fused = torch.nn.Parameter(torch.empty(12, 4), requires_grad=False)
    w = reads.tensor("model.layers.0.w")
    fused.data.narrow(0, 0, 4).copy_(w[0, :4])
    fused.data.narrow(0, 4, 8).copy_(w[5])
    head = torch.nn.Parameter(torch.empty(8, 12, dtype=torch.bfloat16), requires_grad=False)
    head.data.copy_(reads.tensor("model.layers.1.b").narrow(0, 8, 8))
    torch.empty(8, 4, device="meta").copy_(w[1])
    reads.run()
    assert torch.equal(fused, torch.cat([W[0, :4], W[5]]))
    assert torch.equal(head, B[8:])
    assert reads.totals.bytes_read == (4 + 8) * 4 * 4 + 8 * 12 * 2


def test_without_deferral_each_copy_is_read_at_once(checkpoint):
    reads = BoxReads(checkpoint, ReadOptions(), deferred=False)
    out = torch.empty(8, 4)
    out.copy_(reads.tensor("model.layers.0.w")[2])
    assert torch.equal(out, W[2]) and reads.totals.bytes_read == 8 * 4 * 4


def test_a_box_copied_again_is_counted(checkpoint):
    """vLLM's layer-wise reload replays some loads: the report says how much was asked for twice."""
    reads = BoxReads(checkpoint, ReadOptions(), deferred=False)
    w = reads.tensor("model.layers.0.w")
    for _ in range(2):
        torch.empty(8, 4).copy_(w[2])
    torch.empty(8, 4).copy_(w[3])
    assert reads.totals.bytes_read == 3 * 8 * 4 * 4 and reads.totals.bytes_repeated == 8 * 4 * 4


def test_copies_into_another_dtype_are_counted_by_path(checkpoint):
    """The report's `casts`: stored bytes read into another dtype, by dtype path (a loader's
    own `.to` in between); a copy into the stored dtype (a pre-quantized weight loaded as
    stored) counts nothing."""
    reads = BoxReads(checkpoint, ReadOptions())
    w, b = reads.tensor("model.layers.0.w"), reads.tensor("model.layers.1.b")
    torch.empty(8, 4).copy_(w[0])  # float32 as stored
    torch.empty(12, dtype=torch.bfloat16).copy_(b[0])  # bfloat16 as stored
    torch.empty(8, 4, dtype=torch.float16).copy_(w[1])
    torch.empty(8, 4, dtype=torch.float16).copy_(w[2].to(torch.bfloat16))
    reads.run()
    assert reads.totals.casts == {"float32->float16": 8 * 4 * 4, "float32->bfloat16->float16": 8 * 4 * 4}


def test_a_copy_of_another_shape_is_refused(checkpoint):
    reads = BoxReads(checkpoint, ReadOptions())
    with pytest.raises(ShapeMismatchError, match="model.layers.0.w"):
        torch.empty(4, 4).copy_(reads.tensor("model.layers.0.w")[0])


def test_extra_config_keys():
    config = LoaderConfig.of({"reader": "pread", "max_host_bytes": 1 << 20, "remote": {"concurrency": 4}})
    assert config.read.reader == "pread" and config.read.max_host_bytes == 1 << 20
    assert isinstance(config.remote, RemoteOptions)
    with pytest.raises(ArgumentError, match="did you mean 'reader'"):
        LoaderConfig.of({"readr": "pread"})
    with pytest.raises(ArgumentError, match="mesh.*does not apply"):
        LoaderConfig.of({"mesh": None})
    config = LoaderConfig.of({"rank_timeout": 5, "cooperative": False})  # TP workers sharing a URL's fetches
    assert (config.rank_timeout, config.cooperative) == (5, False)
    with pytest.raises(ArgumentError, match="'rank_timeout' must be a positive number"):
        LoaderConfig.of({"rank_timeout": 0})
    with pytest.raises(ArgumentError, match="'cooperative' must be true or false"):
        LoaderConfig.of({"cooperative": "no"})
    with pytest.raises(PlanError, match="unknown reader"):
        LoaderConfig.of({"reader": "fast"})


def test_boxes_read_from_a_url_sum_the_remote_counts(tmp_path):
    """Two reads of a checkpoint behind an HTTP server: the report's remote counts add up
    (the reader's list of unversioned files among them)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from remote_servers import RangeServer

    (tmp_path / "ckpt").mkdir()
    save_file({"model.layers.0.w": W}, tmp_path / "ckpt" / "a.safetensors")
    with RangeServer(str(tmp_path)) as server:
        reads = BoxReads(StoredCheckpoint(server.url + "/ckpt/a.safetensors", remote=RemoteOptions(merge_gap=0)),
                         ReadOptions(), deferred=False)
        first, second = torch.empty(8, 4), torch.empty(4, 4)
        first.copy_(reads.tensor("model.layers.0.w")[1])
        second.copy_(reads.tensor("model.layers.0.w")[2].narrow(0, 4, 4))
    assert torch.equal(first, W[1]) and torch.equal(second, W[2, 4:])
    fields = reads.totals.fields
    assert reads.totals.reader == "remote" and fields["requests"] == 2 and fields["unversioned"] == []
    assert fields["bytes_served"] == reads.totals.bytes_read == (8 + 4) * 4 * 4


def test_extra_config_weights():
    assert LoaderConfig.of({"weights": "s3://bucket/llama/"}).weights == "s3://bucket/llama/"
    assert LoaderConfig.of({}).weights is None
    for bad in ("", 3):
        with pytest.raises(ArgumentError, match="'weights' must be the checkpoint's path or URL"):
            LoaderConfig.of({"weights": bad})


def test_a_reload_announces_the_next_layer_before_reading_this_one(tmp_path, monkeypatch):
    """Copies read as they are made (vLLM's reload) on cold pages: given the boxes to expect
    (the load's), the first copy of each layer announces that layer and the next before it
    is read, as a load's engine does; the report counts the bytes announced ahead."""
    from checkpoints import evict
    from lazyload.readers.mmap import MmapReader
    from lazyload.schedule import layer_of

    layers = [torch.randn(64, 1024, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for k, w in enumerate(layers):
        save_file({f"model.layers.{k}.w": w}, tmp_path / f"{k}.safetensors")
    checkpoint = StoredCheckpoint(tmp_path)
    if not evict(checkpoint.files):
        pytest.skip("the page cache cannot be dropped here (posix_fadvise)")
    events = []
    announce = MmapReader.prefetch
    monkeypatch.setattr(MmapReader, "prefetch", lambda self, items: (
        events.append(("announced", {layer_of(i.target) for i in items})), announce(self, items))[1])
    reads = BoxReads(checkpoint, ReadOptions(), deferred=False)
    read = reads._read
    submitted = lambda: {layer for layer, k in reads.prefetch.layers.items() if k in reads.prefetch.announced}
    monkeypatch.setattr(reads, "_read", lambda copies: (events.append(("read", layer_of(copies[0].name), submitted())),
                                                        read(copies))[1])
    boxes = [(f"model.layers.{k}.w", ((0, 32), (0, 1024))) for k in range(3)]  # a TP rank's half of each
    reads.expect(boxes)
    out = [torch.empty(32, 1024) for _ in layers]
    for k, w in enumerate(layers):
        out[k].copy_(reads.tensor(f"model.layers.{k}.w")[:32])
    reads.close()
    assert all(torch.equal(o, w[:32]) for o, w in zip(out, layers))
    # each layer's read starts with the next layer's announcement on its way (the prefetch thread)
    assert [e[1:] for e in events if e[0] == "read"] == [
        ("model.layers.0", {"model.layers.0", "model.layers.1"}),
        ("model.layers.1", {"model.layers.0", "model.layers.1", "model.layers.2"}),
        ("model.layers.2", {"model.layers.0", "model.layers.1", "model.layers.2"})], events
    assert {layer for kind, *what in events if kind == "announced" for layer in what[0]} == {
        f"model.layers.{k}" for k in range(3)}, events  # each layer's pages announced
    assert reads.totals.prefetched_bytes == 2 * 32 * 1024 * 4  # layers 1 and 2 were announced ahead
