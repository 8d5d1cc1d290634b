"""The index: every tensor of every file from the safetensors headers alone."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoints import (data_starts, evict, header_bytes, index_json, rchar, read_header,
                         resident_data_bytes, shard_files, tensor_bytes, weight_map,
                         write_raw_safetensors)
from lazyload import LazyCheckpoint
from lazyload.errors import CheckpointError, LazyLoadError

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
             "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def index(paths):
    """LazyCheckpoint(paths) with its index built (it may be built on first use)."""
    ckpt = LazyCheckpoint(paths)
    ckpt.keys()
    return ckpt


def assert_entries_match_files(ckpt, files):
    """Every entry's dtype, shape and byte range agree with the header as read by hand,
    and its bytes are the tensor's bytes."""
    expected = {}
    for f in files:
        n, header = read_header(f)
        for key, info in header.items():
            if key == "__metadata__":
                continue
            expected[key] = (str(f), n, info)
    assert sorted(ckpt.keys()) == sorted(expected)
    assert len(ckpt) == len(expected)
    total = 0
    for key, (f, n, info) in expected.items():
        assert key in ckpt
        e = ckpt.entry(key)
        assert e.key == key
        assert os.path.samefile(e.file, f)
        assert e.dtype == ST_DTYPES[info["dtype"]]
        assert tuple(e.shape) == tuple(info["shape"])
        assert (e.start, e.end) == (8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1])
        assert e.nbytes == e.end - e.start
        total += e.nbytes
    assert ckpt.total_bytes == total
    assert sorted(os.path.realpath(p) for p in ckpt.files) == sorted(os.path.realpath(p) for p in files)


def test_index_from_directory_with_index_json(checkpoint):
    directory, _ = checkpoint("llama", "fp32")
    files = shard_files(directory)
    assert len(files) >= 3 and index_json(directory).exists()
    ckpt = LazyCheckpoint(str(directory))
    assert_entries_match_files(ckpt, files)
    assert set(ckpt.keys()) == set(weight_map(directory))
    assert "model.embed_tokens.weight" in ckpt
    assert "model.nonexistent.weight" not in ckpt
    e = ckpt.entry("model.layers.0.self_attn.k_proj.weight")
    assert e.dtype == torch.float32 and tuple(e.shape) == (32, 64)  # 2 kv heads x 16


def test_entry_bytes_are_the_tensor(checkpoint):
    directory, _ = checkpoint("qwen2", "bf16")
    ckpt = LazyCheckpoint(str(directory))
    for key in ["model.layers.1.self_attn.q_proj.bias", "lm_head.weight", "model.norm.weight"]:
        e = ckpt.entry(key)
        with open(e.file, "rb") as f:
            f.seek(e.start)
            raw = f.read(e.nbytes)
        with safe_open(e.file, "pt") as f:
            t = f.get_tensor(key)
        assert e.dtype == torch.bfloat16
        assert raw == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_index_from_directory_without_index_json(checkpoint, tmp_path):
    directory, _ = checkpoint("mixtral", "fp32")
    for f in shard_files(directory):
        os.link(f, tmp_path / f.name)
    ckpt = LazyCheckpoint(str(tmp_path))
    assert_entries_match_files(ckpt, shard_files(tmp_path))
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in ckpt


def test_index_from_single_file(checkpoint):
    directory, _ = checkpoint("gpt2", "bf16")
    f = shard_files(directory)[1]
    ckpt = LazyCheckpoint(str(f))
    assert_entries_match_files(ckpt, [f])
    assert len(ckpt) < len(weight_map(directory))


def test_index_from_list_of_files(checkpoint):
    directory, _ = checkpoint("llama4_text", "fp32")
    files = shard_files(directory)[:2]
    ckpt = LazyCheckpoint([str(f) for f in files])
    assert_entries_match_files(ckpt, files)


def test_index_from_glob(checkpoint):
    directory, _ = checkpoint("bert", "fp32")
    ckpt = LazyCheckpoint(str(Path(directory) / "*.safetensors"))
    assert_entries_match_files(ckpt, shard_files(directory))
    ckpt = LazyCheckpoint(str(Path(directory) / "model-0000[12]-*.safetensors"))
    assert_entries_match_files(ckpt, shard_files(directory)[:2])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(sorted(ST_DTYPES)),
                          st.lists(st.integers(0, 5), min_size=0, max_size=3)),
                min_size=1, max_size=6))
def test_index_property_dtypes_and_shapes(tmp_path_factory, specs):
    """Files written by safetensors itself with assorted dtypes/shapes (scalars and empty
    tensors included) index to exactly what their headers say."""
    d = tmp_path_factory.mktemp("prop")
    tensors = {f"t{i}.{dt.lower()}": torch.zeros(shape, dtype=ST_DTYPES[dt])
               for i, (dt, shape) in enumerate(specs)}
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[::2]}, str(d / "a.safetensors"))
    files = [d / "a.safetensors"]
    if keys[1::2]:
        save_file({k: tensors[k] for k in keys[1::2]}, str(d / "b.safetensors"))
        files.append(d / "b.safetensors")
    ckpt = LazyCheckpoint(str(d))
    assert_entries_match_files(ckpt, files)
    for k, t in tensors.items():
        assert ckpt.entry(k).nbytes == t.numel() * t.element_size()


# ---------------------------------------------------------------------- header only

def test_header_bytes_read_is_headers_only(checkpoint):
    directory, _ = checkpoint("mixtral", "bf16")
    files = shard_files(directory)
    ckpt = index(str(directory))
    assert ckpt.header_bytes_read == header_bytes(files)
    assert ckpt.header_bytes_read < tensor_bytes(files)


@pytest.fixture(scope="module")
def big_files(tmp_path_factory):
    """Three 32 MiB files: big next to their headers and next to kernel readahead."""
    d = tmp_path_factory.mktemp("big")
    for i in range(3):
        save_file({f"w{i}.a": torch.zeros(4 << 20, dtype=torch.float32),
                   f"w{i}.b": torch.zeros(4 << 20, dtype=torch.float32)},
                  str(d / f"part-{i}.safetensors"))
    return d


def test_indexing_reads_no_tensor_bytes(big_files):
    files = shard_files(big_files)
    total = tensor_bytes(files)
    starts = data_starts(files)
    evicted = evict(files)
    r0 = rchar()
    ckpt = index(str(big_files))
    r1 = rchar()
    assert ckpt.total_bytes == total
    assert ckpt.header_bytes_read == header_bytes(files)
    if r0 is not None:
        assert r1 - r0 < total // 100, f"read {r1 - r0} bytes to index {total} bytes of tensors"
    if evicted:  # page cache tells whether the data pages were touched (read or mmap)
        resident = resident_data_bytes(starts)
        assert resident < total // 4, f"{resident} of {total} tensor bytes pulled into the page cache"


@pytest.mark.slow
def test_indexing_huge_checkpoint_is_header_only(tmp_path):
    """~800 MB of tensors; indexing must stay at header cost."""
    for i in range(4):
        save_file({f"layer{i}.w{j}": torch.zeros(25 << 20, dtype=torch.float16) for j in range(4)},
                  str(tmp_path / f"m-{i}.safetensors"))
    files = shard_files(tmp_path)
    total = tensor_bytes(files)
    starts = data_starts(files)
    evicted = evict(files)
    r0 = rchar()
    ckpt = index(str(tmp_path / "*.safetensors"))
    r1 = rchar()
    assert ckpt.total_bytes == total and len(ckpt) == 16
    assert ckpt.header_bytes_read == header_bytes(files)
    if r0 is not None:
        assert r1 - r0 < 1 << 20
    if evicted:
        assert resident_data_bytes(starts) < total // 20


# --------------------------------------------------------------------------- errors

def test_duplicate_key_across_files_names_both_files_and_key(tmp_path):
    save_file({"shared.weight": torch.zeros(2), "a.weight": torch.ones(3)}, str(tmp_path / "first.safetensors"))
    save_file({"shared.weight": torch.ones(2), "b.weight": torch.ones(3)}, str(tmp_path / "second.safetensors"))
    for paths in (str(tmp_path), [str(tmp_path / "first.safetensors"), str(tmp_path / "second.safetensors")]):
        with pytest.raises(CheckpointError) as e:
            index(paths)
        msg = str(e.value)
        assert "shared.weight" in msg and "first.safetensors" in msg and "second.safetensors" in msg, msg
        assert isinstance(e.value, LazyLoadError)


def test_index_json_key_absent_from_its_file(checkpoint, tmp_path):
    directory, _ = checkpoint("llama", "bf16")
    for f in shard_files(directory):
        os.link(f, tmp_path / f.name)
    idx = json.loads(index_json(directory).read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    idx["weight_map"]["model.layers.0.ghost.weight"] = shard
    (tmp_path / index_json(directory).name).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as e:
        index(str(tmp_path))
    msg = str(e.value)
    assert "model.layers.0.ghost.weight" in msg, msg
    assert "model.safetensors.index.json" in msg, msg
    assert shard in msg, msg


def test_unknown_dtype_names_file_key_and_dtype(tmp_path):
    write_raw_safetensors(tmp_path / "good.safetensors", {"ok": ("F32", [2], b"\0" * 8)})
    bad = write_raw_safetensors(tmp_path / "weird.safetensors",
                                {"fine": ("F16", [2], b"\0" * 4), "odd.weight": ("Q9", [4], b"\0" * 4)})
    with pytest.raises(CheckpointError) as e:
        index(str(tmp_path))
    msg = str(e.value)
    assert "weird.safetensors" in msg and "odd.weight" in msg and "Q9" in msg, msg
    with pytest.raises(CheckpointError, match="Q9"):
        index(str(bad))


def test_tensor_bytes_outside_the_file(tmp_path):
    """A header promising more bytes than the file holds (a truncated download)."""
    path = write_raw_safetensors(tmp_path / "short.safetensors", {"w": ("F32", [16], b"\0" * 64)})
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 16)
    with pytest.raises(CheckpointError) as e:
        index(str(path))
    assert "short.safetensors" in str(e.value)


def test_garbage_header(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b"not json!!!!" + b"\0" * 16)
    with pytest.raises(CheckpointError) as e:
        index(str(path))
    assert "junk.safetensors" in str(e.value)


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(CheckpointError) as e:
        index(str(missing))
    assert str(missing) in str(e.value)
    assert isinstance(e.value, LazyLoadError)


def test_empty_directory(tmp_path):
    (tmp_path / "README.md").write_text("no weights here")
    with pytest.raises(CheckpointError) as e:
        index(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_glob_matching_nothing(tmp_path):
    pattern = str(tmp_path / "*.safetensors")
    with pytest.raises(CheckpointError) as e:
        index(pattern)
    assert pattern in str(e.value) or str(tmp_path) in str(e.value)


def test_page_cache_probe_sees_reads(big_files):
    """The harness itself: after evicting, a real read (and an mmap read through
    safetensors) shows up as resident data, so the checks above can fail."""
    files = shard_files(big_files)
    starts = data_starts(files)
    if not evict(files):
        pytest.skip("page cache cannot be emptied here")
    assert resident_data_bytes(starts) == 0
    with open(files[0], "rb") as f:
        f.read()
    with safe_open(str(files[1]), "pt") as f:
        for k in f.keys():
            f.get_tensor(k).clone()  # touch every byte of the mapping
    assert resident_data_bytes(starts) >= 2 * tensor_bytes(files) // 3 - (1 << 20)
