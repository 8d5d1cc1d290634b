"""torch.distributed.checkpoint (DCP) directories as sources: checkpoints written by torch's
own `dcp.save` (a plain Llama state dict beside its AdamW state, and an FSDP2 x TP (2 x 2)
Llama saved by 4 gloo ranks) load into meta-built transformers models bit-exact against
`dcp.load`, at world 1 and at world 2 under gloo, each rank reading less than 0.75x the
checkpoint; bad metadata or chunks are CheckpointErrors before any tensor byte is read."""
from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import shutil
import struct
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import build_model
from dcp_checkpoints import dcp_reference, llama, save_chunked, save_fsdp_tp, save_plain
from gloo import run_job, spawn_cases
from lazyload import CheckpointError, LazyCheckpoint
from lazyload.formats.dcp import check_chunks
from lazyload.formats.dcp_metadata import Chunk, TensorMeta

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (dir, dtype, the DCP checkpoint dcp.load reads as the reference, its key
    prefix), written by dcp.save; "hf_sharded" / "hf_consolidated": the FSDP x TP model saved
    by HuggingFaceStorageWriter (per-rank files, and their consolidated copy)."""
    root = tmp_path_factory.mktemp("dcp")
    save_plain(root / "plain")
    save_fsdp_tp(root / "fsdp_tp", root)
    fsdp = str(root / "fsdp_tp")
    return {"plain": (str(root / "plain"), torch.float32, str(root / "plain"), "model."),
            "fsdp_tp": (fsdp, torch.bfloat16, fsdp, ""),
            "hf_sharded": (f"{fsdp}-hf/sharded", torch.bfloat16, fsdp, ""),
            "hf_consolidated": (f"{fsdp}-hf", torch.bfloat16, fsdp, "")}


def _assert_same_state(model, ref, label):
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        tensor = got[key].full_tensor() if hasattr(got[key], "full_tensor") else got[key]
        assert tensor.dtype == value.dtype and torch.equal(tensor, value), f"{label}: {key} differs from dcp.load"


@pytest.mark.parametrize("name", ["plain", "fsdp_tp", "hf_sharded", "hf_consolidated"])
def test_dcp_loads_exactly_as_dcp_load(saved, name):
    path, dtype, reference, prefix = saved[name]
    model = build_model("llama", llama()[1], dtype)
    checkpoint = LazyCheckpoint(path)
    report = checkpoint.load_into(model, progress=False)
    assert report.ok
    _assert_same_state(model, dcp_reference(reference, prefix), name)
    assert not [n for n in checkpoint.index.names() if n.startswith("optimizer.")]  # training state left out


def test_trainer_save_is_indexed_under_the_models_names(tmp_path):
    """`dcp.save({"model": state_dict, "optimizer": ...})` (a trainer's save) keeps `model.` on
    every fqn; the index names its tensors as the model's state dict does (what vLLM's weight
    loaders and a trainer's WeightSync know), and load_into still loads them exactly."""
    save_plain(tmp_path / "trainer")
    model, config = llama(torch.float32)
    checkpoint = LazyCheckpoint(tmp_path / "trainer")
    assert sorted(checkpoint.index.names()) == sorted(model.state_dict())
    target = build_model("llama", config, torch.float32)
    assert checkpoint.load_into(target, progress=False).ok
    _assert_same_state(target, dcp_reference(tmp_path / "trainer", "model."), "trainer")


@pytest.mark.parametrize("state, names", [
    ({"model.layers.0.weight": 1, "lm_head.weight": 2}, ["lm_head.weight", "model.layers.0.weight"]),  # no group
    ({"model": {"w": 1}, "w": 2}, ["model.w", "w"]),  # "w" taken: names as saved
    ({"model": {"rng.seed": 1}}, ["model.rng.seed"]),  # would read as training state: as saved
])
def test_names_are_kept_as_saved_unless_a_model_group_holds_them_all(tmp_path, state, names):
    import torch.distributed.checkpoint as dcp

    as_tensors = lambda tree: {k: as_tensors(v) if isinstance(v, dict) else torch.full((2,), float(v))  # noqa: E731
                               for k, v in tree.items()}
    dcp.save(as_tensors(state), checkpoint_id=str(tmp_path), no_dist=True)
    assert sorted(LazyCheckpoint(tmp_path).index.names()) == names


def test_fsdp_tp_chunks_are_boxes_of_global_tensors(saved, monkeypatch):
    """FSDP2's _StridedShard under TP: q_proj's 4 row chunks are listed interleaved (rank
    order), and each is a box of the global tensor; indexing reads no byte of any tensor."""
    from lazyload.formats import ranges

    reads, real = [], os.pread

    def pread(fd, length, offset):
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, offset + length))
        return real(fd, length, offset)

    monkeypatch.setattr(ranges.os, "pread", pread)
    index = LazyCheckpoint(saved["fsdp_tp"][0]).index
    monkeypatch.undo()
    assert reads and not [(f, a, b) for f, a, b in reads for e in index.entries()
                          if e.file == f and a < e.end and e.start < b]
    rows = [int(k.split("@")[1].split(",")[0]) for k in index.expr(Q_PROJ).keys()]
    assert rows == [0, 16, 32, 48] and index.shape(Q_PROJ) == (64, 64)
    o_proj = index.expr("model.layers.0.self_attn.o_proj.weight").keys()
    assert len(o_proj) == 4 and all(index[k].shape == (32, 32) for k in o_proj)
    assert index.header_bytes_read >= sum(b - a for _, a, b in reads)


def _case_world2(case, rank, world):
    path, dtype, reference, prefix = case
    model = build_model("llama", llama()[1], dtype)
    report = LazyCheckpoint(path).load_into(model, rank, world, progress=False)
    assert report.ok
    _assert_same_state(model, dcp_reference(reference, prefix), f"{path} rank {rank} of {world}")
    total = LazyCheckpoint(path).index.total_bytes
    assert report.bytes_read + report.bytes_mapped < 0.75 * total, (report.bytes_read, report.bytes_mapped, total)


def test_dcp_loads_at_world_2_under_gloo(saved, tmp_path):
    spawn_cases(2, [saved["plain"], saved["fsdp_tp"], saved["hf_sharded"]], tmp_path, _case_world2)


def test_hf_sharded_files_must_tile_each_tensor(saved, tmp_path):
    """Rank 0's file gone: the chunks at row 0 are missing, a CheckpointError naming the
    tensor before any byte is read (a missing last chunk only shrinks the inferred size,
    which the mapping refuses as a shape mismatch)."""
    directory = tmp_path / "sharded"
    shutil.copytree(saved["hf_sharded"][0], directory)
    (directory / "shard-00001-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="do not cover the tensor"):
        LazyCheckpoint(str(directory)).load_into(build_model("llama", llama()[1], torch.bfloat16), progress=False)


# ----------------------------------------------------------------------------- bad input


def _copy(saved, tmp_path, edit) -> str:
    """A copy of the FSDP x TP checkpoint whose metadata `edit(metadata)` changed."""
    directory = tmp_path / "bad"
    shutil.copytree(saved["fsdp_tp"][0], directory)
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata, directory)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return str(directory)


def _chunks(metadata):
    return metadata.state_dict_metadata[Q_PROJ].chunks


def _drop_chunk(metadata, _):
    _chunks(metadata).pop()


def _overlap_chunk(metadata, _):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _chunks(metadata)[1] = ChunkStorageMetadata(torch.Size([8, 0]), torch.Size([16, 64]))  # rows 8:24 over 0:16


def _transformed(metadata, _):
    for index, info in metadata.storage_data.items():
        if index.fqn == Q_PROJ:
            info.transform_descriptors = ["zstd"]


def _unknown_class(metadata, _):
    metadata.planner_data = os.system  # pickled as a reference to posix.system


def _rezip(metadata, directory, compression):
    """Q_PROJ's first chunk rewritten by Python's zipfile (records compressed, or stored
    without torch's 64-byte alignment), appended to its file and pointed at."""
    import io
    import zipfile

    for index, info in metadata.storage_data.items():
        if index.fqn == Q_PROJ and index.offset == torch.Size([0, 0]):
            path = directory / info.relative_path
            with open(path, "rb") as f:
                f.seek(info.offset)
                original = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
            out = io.BytesIO()
            with zipfile.ZipFile(out, "w", compression) as z:
                for record in original.infolist():
                    z.writestr(record.filename, original.read(record.filename))
            with open(path, "ab") as f:
                info.offset, info.length = f.seek(0, 2), len(out.getvalue())
                f.write(out.getvalue())


def _parameter_chunk(metadata, directory):
    """Q_PROJ's first chunk replaced by torch.save of an nn.Parameter: a stored, aligned zip
    whose data.pkl names torch._utils._rebuild_parameter (not a plain tensor's pickle)."""
    import io

    for index, info in metadata.storage_data.items():
        if index.fqn == Q_PROJ and index.offset == torch.Size([0, 0]):
            buffer = io.BytesIO()
            torch.save(torch.nn.Parameter(torch.zeros(16, 64, dtype=torch.bfloat16)), buffer)
            with open(directory / info.relative_path, "ab") as f:
                info.offset, info.length = f.seek(0, 2), len(buffer.getvalue())
                f.write(buffer.getvalue())


@pytest.mark.parametrize("edit, message", [
    (_parameter_chunk, "names torch._utils._rebuild_parameter"),
    (_drop_chunk, "do not cover the tensor"),
    (_overlap_chunk, "overlapping chunks"),
    (_transformed, "stored transformed (zstd)"),
    (_unknown_class, "names the class posix.system"),
    (lambda m, d: _rezip(m, d, 8), "is compressed (zip method 8)"),
    (lambda m, d: _rezip(m, d, 0), "not 64-byte aligned"),
])
def test_bad_dcp_checkpoints_are_refused_before_any_tensor_byte(saved, tmp_path, edit, message):
    path = _copy(saved, tmp_path, edit)
    model = build_model("llama", llama()[1], torch.bfloat16)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        LazyCheckpoint(path).load_into(model, progress=False)
    assert Q_PROJ in str(info.value) or "posix.system" in str(info.value)
    assert all(t.is_meta for t in model.state_dict().values())  # untouched: every tensor still on meta


# ----------------------------------------------------------------------------- many chunks

INDEX_CHUNKED = """
import sys
from lazyload import LazyCheckpoint
index = LazyCheckpoint(sys.argv[1]).index
print(index.shape("w"), len(index.expr("w").keys()))
"""


def test_tens_of_thousands_of_chunks_index_in_linear_time(tmp_path):
    """A [1, 40000] tensor saved as 40,000 chunks of [1, 1]: the chunks' tiling is checked
    without comparing pairs of them (all-pairs took minutes here), so indexing ends within
    a generous bound."""
    save_chunked(tmp_path, "w", 40_000)
    result = run_job([sys.executable, "-c", INDEX_CHUNKED, str(tmp_path)], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["(1,", "40000)", "40000"]


@st.composite
def chunked_tensors(draw):
    """A small tensor and chunks of it: a grid's cells (an exact tiling), some of them
    moved, dropped or repeated."""
    size = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else [] for n in size]
    spans = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, size)]
    chunks = [Chunk(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)) for cell in itertools.product(*spans)]
    for _ in range(draw(st.integers(0, 2))):
        if not chunks:
            break
        i = draw(st.integers(0, len(chunks) - 1))
        c = chunks[i]
        offsets = tuple(draw(st.integers(0, n - s)) for n, s in zip(size, c.sizes))
        action = draw(st.sampled_from(["move", "drop", "repeat"]))
        if action == "drop":
            chunks.pop(i)
        elif offsets not in {c.offsets for c in chunks}:
            chunks[i:i + 1] = [Chunk(offsets, c.sizes)] + ([c] if action == "repeat" else [])
    return TensorMeta(torch.float32, size, tuple(chunks))


def _coverage(meta: TensorMeta) -> torch.Tensor:
    """How many chunks hold each element, counted element by element."""
    count = torch.zeros(meta.size, dtype=torch.int64)
    for c in meta.chunks:
        count[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
    return count


@settings(max_examples=300, deadline=None)
@given(chunked_tensors())
def test_chunk_check_agrees_with_counting_every_element(meta):
    """check_chunks refuses exactly the chunk lists that do not hold every element once,
    and an overlap it names is one: both chunks hold the element it found."""
    count = _coverage(meta)
    if bool((count == 1).all()):
        assert len(check_chunks("m", "w", meta)) == len(meta.chunks)
        return
    with pytest.raises(CheckpointError) as info:
        check_chunks("m", "w", meta)
    message = str(info.value)
    if int(count.sum()) < count.numel():
        assert "do not cover the tensor" in message, message
        return
    assert "overlapping chunks" in message, message
    named = re.search(r"at (\[[\d, ]*\]) and (\[[\d, ]*\])", message)
    if named:
        a, b = ([c for c in meta.chunks if list(c.offsets) == json.loads(at)][0] for at in named.groups())
        assert all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def test_chunks_cut_along_too_many_dims_are_refused():
    """The tiling check costs 2^dims per chunk of the dims chunks are cut along: a tensor
    cut along more dims than any mesh shards is refused, naming it."""
    size = (2,) * 7
    cells = [Chunk(offsets, (1,) * 7) for offsets in itertools.product((0, 1), repeat=7)]
    with pytest.raises(CheckpointError, match="'w' of size .* is cut into chunks along 7 dims"):
        check_chunks("m", "w", TensorMeta(torch.float32, size, tuple(cells)))
    assert len(check_chunks("m", "w", TensorMeta(torch.float32, size[:6], tuple(Chunk(c.offsets[:6], c.sizes[:6])
                                                                             for c in cells[::2])))) == 64


# ----------------------------------------------------------------------------- hostile values
# Python's str() refuses integers over 4,300 digits; above int64 no size or offset is real.
HUGE, BEYOND_INT64 = 10 ** 5000, 2 ** 64


def _set_chunk(field, value):
    def edit(metadata, _):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        first = _chunks(metadata)[0]
        fields = {"offsets": first.offsets, "sizes": first.sizes, field: torch.Size([value, 0])}
        _chunks(metadata)[0] = ChunkStorageMetadata(fields["offsets"], fields["sizes"])
    return edit


def _set_size(value):
    def edit(metadata, _):
        metadata.state_dict_metadata[Q_PROJ].size = torch.Size([value, 64])
    return edit


def _set_storage(field, value):
    def edit(metadata, _):
        for index, info in metadata.storage_data.items():
            if index.fqn == Q_PROJ:
                setattr(info, field, value)
    return edit


def _int_fqn(metadata, _):
    metadata.state_dict_metadata[HUGE] = metadata.state_dict_metadata.pop(Q_PROJ)


@pytest.mark.parametrize("edit, message", [
    (_set_chunk("offsets", HUGE), "a chunk offset of"),
    (_set_chunk("offsets", BEYOND_INT64), "a chunk offset of"),
    (_set_chunk("sizes", HUGE), "a chunk size of"),
    (_set_chunk("sizes", BEYOND_INT64), "a chunk size of"),
    (_set_size(HUGE), "the size of"),
    (_set_size(-HUGE), "the size of"),
    (_set_size(BEYOND_INT64), "the size of"),
    (_set_storage("offset", HUGE), "the storage of"),
    (_set_storage("offset", BEYOND_INT64), "the storage of"),
    (_set_storage("length", BEYOND_INT64), "the storage of"),
    (_set_storage("relative_path", "__0_\x000.distcp"), "the storage of"),
    (_set_storage("transform_descriptors", [HUGE]), "the storage of"),
    (_int_fqn, "is not a named storage record"),
], ids=["offset-huge", "offset-2**64", "size-huge", "size-2**64", "tensor-huge", "tensor-negative-huge",
        "tensor-2**64", "storage-offset-huge", "storage-offset-2**64", "storage-length-2**64", "relative-path-nul",
        "transform-int", "fqn-int"])
def test_hostile_metadata_values_are_checkpoint_errors(saved, tmp_path, edit, message):
    """Integers too long to print or beyond int64, a NUL in a file name, a transform that
    is no name: a CheckpointError naming the .metadata (and the tensor), never Python's
    ValueError, before any tensor byte is read."""
    path = _copy(saved, tmp_path, edit)
    model = build_model("llama", llama()[1], torch.bfloat16)
    with pytest.raises(CheckpointError) as info:
        LazyCheckpoint(path).load_into(model, progress=False)
    text = str(info.value)
    assert ".metadata" in text and len(text) < 2000, text
    if message != "is not a named storage record":
        assert message in text and Q_PROJ in text, text
    assert all(t.is_meta for t in model.state_dict().values())


def _rewrite_header(path, edit) -> None:
    """The safetensors file at `path` with its header JSON changed in place by `edit(header)`."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _sharding_info(header) -> dict:
    return json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])


def _offsets_of_q_proj(value):
    def edit(header):
        info = _sharding_info(header)
        info[Q_PROJ]["saved_offsets"] = [value, 0]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    return edit


@pytest.mark.parametrize("edit, message", [
    (_offsets_of_q_proj(10 ** 4300 - 1), "no saved_offsets list"),  # 4300 digits: the size adds a 4301st
    (_offsets_of_q_proj(BEYOND_INT64), "no saved_offsets list"),
    (lambda h: h["__metadata__"].update(DCP_SHARDING_INFO="[" * 100_000 + "]" * 100_000), "no readable"),
    (lambda h: h.update(__metadata__=["DCP_SHARDING_INFO"]), "no readable"),
], ids=["offset-4300-digits", "offset-2**64", "sharding-info-nested-deep", "metadata-a-list"])
def test_hostile_dcp_safetensors_headers_are_checkpoint_errors(saved, tmp_path, edit, message):
    directory = tmp_path / "sharded"
    shutil.copytree(saved["hf_sharded"][0], directory)
    shard = sorted(directory.glob("*.safetensors"))[0]
    _rewrite_header(shard, edit)
    with pytest.raises(CheckpointError, match=message) as info:
        LazyCheckpoint(str(directory)).index
    assert shard.name in str(info.value) and len(str(info.value)) < 2000
