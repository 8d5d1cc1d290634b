"""Hostile and malformed checkpoints: every bad header or index json is a CheckpointError
naming the file (and key), raised while indexing, with no large allocation."""
from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

from checkpoints import (assert_same_weights, build_model, copy_checkpoint, index_json, reference_model,
                         shard_files, weight_map, write_raw_safetensors)
from lazyload import LazyCheckpoint, Quantization, load_model, save_sharded
from lazyload.errors import ArgumentError, CheckpointError, LazyLoadError, ShapeMismatchError
from lazyload.index import CheckpointIndex


def F32(shape, begin, end) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def file_bytes(header, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: `header` is a JSON-able value or raw bytes; `length` overrides
    the 8-byte header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def index(paths):
    ckpt = LazyCheckpoint(paths)
    ckpt.keys()
    return ckpt


def refused(path, *fragments: str) -> str:
    """Indexing `path` raises a CheckpointError whose message names the file and `fragments`."""
    with pytest.raises(CheckpointError) as e:
        index(str(path))
    msg = str(e.value)
    assert Path(path).name in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


def assert_tiles_the_file(path: str, idx: CheckpointIndex) -> None:
    """An accepted file: every entry within the file, sizes agree with shapes, and in offset
    order the entries cover the data exactly."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    end, size = 8 + n, os.path.getsize(path)
    for e in sorted(idx.entries(), key=lambda e: (e.start, e.end)):
        assert e.start == end and e.end <= size
        assert e.nbytes == math.prod(e.shape) * e.itemsize
        assert len(e.shape) <= 64 and all(type(d) is int and d >= 0 for d in e.shape)
        end = e.end
    assert end == size



# --------------------------------------------------------------------- malformed files
# id -> (file bytes, fragments the message must hold besides the file name)
MALFORMED = {
    "empty-file": (b"", ["too short"]),
    "short-prefix": (b"\x01\x02\x03", ["too short"]),
    "length-zero": (struct.pack("<Q", 0), ["header length 0"]),
    "length-one": (file_bytes(b"{"), ["header length 1"]),
    "length-past-eof": (file_bytes(b"{}", length=64), ["header length 64", "past the end"]),
    "length-99MB-tiny-file": (file_bytes(b"{}", length=99_000_000), ["past the end"]),
    "length-above-cap": (file_bytes(b"{}", length=200_000_000), ["implausible"]),
    "length-max-u64": (file_bytes(b"{}", length=2**64 - 1), ["implausible"]),
    "invalid-utf8": (file_bytes(b'{"w\xff": 1}'), ["not UTF-8"]),
    "utf16-header": (file_bytes("{}".encode("utf-16-le")), ["not valid JSON"]),
    "invalid-json": (file_bytes(b"not json"), ["not valid JSON"]),
    "nul-after-json": (file_bytes(b"{}\0\0"), ["not valid JSON"]),
    "nan-constant": (file_bytes(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": NaN}}',
                                b"\0" * 4), ["not valid JSON"]),
    "deep-nesting": (file_bytes(b"[" * 100_000 + b"]" * 100_000), ["not valid JSON"]),
    "top-level-list": (file_bytes([]), ["JSON list, not an object"]),
    "top-level-string": (file_bytes("w"), ["JSON string"]),
    "top-level-null": (file_bytes(None), ["JSON null"]),
    "entry-list": (file_bytes({"w": [1, 2]}), ["'w'", "JSON list"]),
    "entry-string": (file_bytes({"w": "F32"}), ["'w'", "JSON string"]),
    "missing-data-offsets": (file_bytes({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), ["'w'", "data_offsets"]),
    "missing-dtype": (file_bytes({"w": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), ["'w'", "dtype"]),
    "missing-shape": (file_bytes({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4), ["'w'", "shape"]),
    "dtype-list": (file_bytes({"w": {**F32([1], 0, 4), "dtype": ["F32"]}}, b"\0" * 4), ["'w'", "dtype ['F32']"]),
    "dtype-unknown": (file_bytes({"w": {**F32([1], 0, 4), "dtype": "Q9"}}, b"\0" * 4), ["'w'", "Q9"]),
    "dtype-lowercase": (file_bytes({"w": {**F32([1], 0, 4), "dtype": "f32"}}, b"\0" * 4), ["'w'", "f32"]),
    "shape-int": (file_bytes({"w": F32(4, 0, 16)}, b"\0" * 16), ["'w'", "shape 4"]),
    "shape-negative": (file_bytes({"w": F32([-1], 0, 0)}), ["'w'", "shape [-1]"]),
    "shape-float": (file_bytes({"w": F32([1.0], 0, 4)}, b"\0" * 4), ["'w'", "shape [1.0]"]),
    "shape-bool": (file_bytes({"w": F32([True], 0, 4)}, b"\0" * 4), ["'w'", "shape [True]"]),
    "shape-string-dim": (file_bytes({"w": F32(["4"], 0, 16)}, b"\0" * 16), ["'w'", "shape ['4']"]),
    "shape-rank-100000": (file_bytes({"w": F32([1] * 100_000, 0, 4)}, b"\0" * 4), ["'w'", "at most 64"]),
    "shape-dim-2**64": (file_bytes({"w": F32([0, 2**64], 0, 0)}), ["'w'", "shape"]),
    "shape-2**40-elements": (file_bytes({"w": F32([2**20, 2**20], 0, 4)}, b"\0" * 4), ["'w'", "needs 4398046511104"]),
    "shape-size-mismatch": (file_bytes({"w": F32([3], 0, 8)}, b"\0" * 8), ["'w'", "spans 8 bytes", "needs 12"]),
    "offsets-int": (file_bytes({"w": {**F32([1], 0, 4), "data_offsets": 4}}, b"\0" * 4), ["'w'", "data_offsets 4"]),
    "offsets-three": (file_bytes({"w": {**F32([1], 0, 4), "data_offsets": [0, 4, 4]}}, b"\0" * 4),
                      ["'w'", "data_offsets [0, 4, 4]"]),
    "offsets-negative": (file_bytes({"w": F32([1], -4, 0)}, b"\0" * 4), ["'w'", "data_offsets [-4, 0]"]),
    "offsets-bool": (file_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, b"\0"),
                     ["'w'", "data_offsets [False, True]"]),
    "offsets-float": (file_bytes({"w": F32([1], 0, 4.0)}, b"\0" * 4), ["'w'", "data_offsets [0, 4.0]"]),
    "offsets-reversed": (file_bytes({"w": F32([0], 8, 4)}, b"\0" * 8), ["'w'", "end before they begin"]),
    "overlap": (file_bytes({"a": F32([2], 0, 8), "b": F32([1], 4, 8)}, b"\0" * 8), ["'a'", "'b'", "overlaps"]),
    "same-range": (file_bytes({"a": F32([1], 0, 4), "b": F32([1], 0, 4)}, b"\0" * 4), ["'a'", "'b'", "overlaps"]),
    "gap-between": (file_bytes({"a": F32([1], 0, 4), "b": F32([1], 8, 12)}, b"\0" * 12), ["'b'", "no gap"]),
    "gap-at-start": (file_bytes({"a": F32([1], 4, 8)}, b"\0" * 8), ["'a'", "no gap"]),
    "trailing-bytes": (file_bytes({"a": F32([1], 0, 4)}, b"\0" * 8), ["at the end of the file"]),
    "out-of-file": (file_bytes({"w": F32([16], 0, 64)}, b"\0" * 8), ["'w'", "past the end of the file"]),
    "duplicate-key": (file_bytes(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                 b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 8),
                      ["'w'", "twice"]),
    "duplicate-field": (file_bytes(b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}',
                                   b"\0" * 4), ["'dtype'", "twice"]),
    "duplicate-metadata": (file_bytes(b'{"__metadata__": {"a": "1"}, "__metadata__": {"a": "2"}}'),
                           ["'__metadata__'", "twice"]),
    "metadata-list": (file_bytes({"__metadata__": ["pt"]}), ["__metadata__"]),
    "metadata-int-value": (file_bytes({"__metadata__": {"format": 1}}), ["__metadata__"]),
    "metadata-nested": (file_bytes({"__metadata__": {"format": {"a": "b"}}}), ["__metadata__"]),
    "surrogate-key": (file_bytes(b'{"w\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                                 b"\0" * 4), ["surrogate"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_a_checkpoint_error(tmp_path, case):
    raw, fragments = MALFORMED[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(raw)
    refused(path, *fragments)
    with pytest.raises(CheckpointError):  # the class itself too, not only LazyCheckpoint
        CheckpointIndex([str(path)])


@pytest.mark.parametrize("case", ["gap-between", "trailing-bytes", "overlap", "duplicate-field",
                                  "metadata-int-value", "nan-constant", "shape-dim-2**64"])
def test_safetensors_refuses_them_too(tmp_path, case):
    """The layout and type rules are safetensors' own, not stricter ones of lazyload."""
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(MALFORMED[case][0])
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")


# What safetensors accepts, lazyload accepts: unordered ranges, zero-size tensors sharing
# an offset, extra fields, null metadata, whitespace around the JSON.
ACCEPTED = {
    "unordered-ranges": (file_bytes({"b": F32([1], 4, 8), "a": F32([1], 0, 4)}, b"\0" * 8), {"a", "b"}),
    "empty-tensors-share-offset": (file_bytes({"a": F32([0], 0, 0), "b": F32([1], 0, 4), "c": F32([2, 0], 4, 4)},
                                              b"\0" * 4), {"a", "b", "c"}),
    "extra-field": (file_bytes({"w": {**F32([1], 0, 4), "comment": [1, None]}}, b"\0" * 4), {"w"}),
    "metadata-null": (file_bytes({"__metadata__": None, "w": F32([1], 0, 4)}, b"\0" * 4), {"w"}),
    "whitespace": (file_bytes(b'  {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}  ', b"\0" * 4),
                   {"w"}),
    "no-tensors": (file_bytes({"__metadata__": {"format": "pt"}}), set()),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_what_safetensors_accepts_indexes(tmp_path, case):
    raw, keys = ACCEPTED[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(raw)
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == keys
    ckpt = index(str(path))
    assert set(ckpt.keys()) == keys
    assert_tiles_the_file(str(path), ckpt.index)


# ------------------------------------------------------------------ not regular files

def test_directory_fifo_and_broken_links_are_checkpoint_errors(tmp_path):
    good = write_raw_safetensors(tmp_path / "good.safetensors", {"w": ("F32", [1], b"\0" * 4)})
    (tmp_path / "adir.safetensors").mkdir()
    os.mkfifo(tmp_path / "pipe.safetensors")
    os.symlink("nowhere.safetensors", tmp_path / "dangling.safetensors")
    os.symlink("loop.safetensors", tmp_path / "loop.safetensors")
    for name in ("adir", "pipe", "dangling", "loop"):
        path = tmp_path / f"{name}.safetensors"
        for paths in (str(path), [str(good), str(path)]):
            with pytest.raises(CheckpointError) as e:
                index(paths)
            assert path.name in str(e.value), str(e.value)
        with pytest.raises(CheckpointError) as e:  # the index reads the files it is given
            CheckpointIndex([str(good), str(path)])
        assert path.name in str(e.value), str(e.value)
    with pytest.raises(CheckpointError) as e:  # a glob matching them all; adir sorts first
        index(str(tmp_path / "*.safetensors"))
    assert "adir.safetensors" in str(e.value), str(e.value)


# ------------------------------------------------------------------- bounded memory

@pytest.mark.parametrize("case", ["length-99MB-tiny-file", "shape-2**40-elements", "length-above-cap"])
def test_refused_without_large_allocation(tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(MALFORMED[case][0])
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError):
            CheckpointIndex([str(path)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated to refuse a {path.stat().st_size}-byte file"


def test_huge_shape_beyond_the_file_without_large_allocation(tmp_path):
    """2**40 elements whose range claims 4 TiB of a tiny file."""
    path = tmp_path / "huge.safetensors"
    path.write_bytes(file_bytes({"w": F32([2**40], 0, 2**42)}, b"\0" * 16))
    tracemalloc.start()
    try:
        msg = refused(path, "'w'", "past the end of the file")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20 and len(msg) < 1000


def test_messages_stay_short_for_huge_values(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(file_bytes({"w": {**F32([1], 0, 4), "dtype": "X" * 1_000_000}}, b"\0" * 4))
    assert len(refused(path, "'w'")) < 2000


# ----------------------------------------------------------------------- index json

def write_index_json(directory, doc) -> Path:
    path = index_json(directory)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


INDEX_CASES = {
    "not-json": ("{'weight_map': {}}", ["not valid JSON"]),
    "top-level-list": ([], ["weight_map"]),
    "no-weight-map": ({"metadata": {}}, ["weight_map"]),
    "weight-map-list": ({"weight_map": [["a", "b"]]}, ["weight_map"]),
    "name-not-string": ({"weight_map": {"w": 3}}, ["'w'", "3"]),
    "name-empty": ({"weight_map": {"w": ""}}, ["'w'"]),
    "name-null-byte": ({"weight_map": {"w": "a\0.safetensors"}}, ["'w'"]),
    "parent-dir": ({"weight_map": {"w": "../x.safetensors"}}, ["'w'", "../x.safetensors"]),
    "nested-parent-dir": ({"weight_map": {"w": "sub/../../x.safetensors"}}, ["'w'", "sub/../../x.safetensors"]),
    "absolute-path": ({"weight_map": {"w": "/etc/passwd"}}, ["'w'", "/etc/passwd"]),
    "directory-itself": ({"weight_map": {"w": "."}}, ["'w'"]),
    "missing-file": ({"weight_map": {"w": "model-99999.safetensors"}}, ["model-99999.safetensors", "missing"]),
    "duplicate-key": ('{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', ["'w'", "twice"]),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_malformed_index_json(tmp_path, case):
    doc, fragments = INDEX_CASES[case]
    write_raw_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [1], b"\0" * 4)})
    path = write_index_json(tmp_path, doc)
    for target in (tmp_path, path):
        with pytest.raises(CheckpointError) as e:
            index(str(target))
        msg = str(e.value)
        assert path.name in msg, msg
        for fragment in fragments:
            assert fragment in msg, msg


def test_index_json_that_is_a_directory(tmp_path):
    write_raw_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [1], b"\0" * 4)})
    index_json(tmp_path).mkdir()
    with pytest.raises(CheckpointError) as e:
        index(str(tmp_path))
    assert index_json(tmp_path).name in str(e.value)


def test_traversal_to_a_real_file_is_refused(tmp_path):
    """`../` names a file that exists (a real shard outside the directory): still refused."""
    outside = write_raw_safetensors(tmp_path / "outside.safetensors", {"w": ("F32", [1], b"\0" * 4)})
    inner = tmp_path / "ckpt"
    inner.mkdir()
    for name in ("../outside.safetensors", str(outside)):
        path = write_index_json(inner, {"weight_map": {"w": name}})
        with pytest.raises(CheckpointError) as e:
            index(str(inner))
        assert path.name in str(e.value) and "'w'" in str(e.value) and name in str(e.value)


def test_index_json_as_the_path_loads_its_checkpoint(checkpoint, monkeypatch):
    directory, _ = checkpoint("llama", "fp32")
    by_dir, by_json = index(str(directory)), index(str(index_json(directory)))
    assert by_json.files == by_dir.files and by_json.keys() == by_dir.keys()
    assert set(by_json.keys()) == set(weight_map(directory))
    monkeypatch.chdir(directory)  # a bare name: its directory is the current one
    assert index(index_json(directory).name).keys() == by_dir.keys()


def test_shard_names_with_dot_segments_inside_the_directory(checkpoint, tmp_path):
    """Normalized lexically, each shard is indexed once whatever way its name is spelled."""
    directory, _ = checkpoint("llama", "fp32")
    copy = copy_checkpoint(directory, tmp_path / "ckpt")
    idx = json.loads(index_json(directory).read_text())
    idx["weight_map"] = {k: (f"./sub/../{v}" if i % 2 else v) for i, (k, v) in enumerate(idx["weight_map"].items())}
    write_index_json(copy, idx)
    ckpt = index(str(copy))
    assert ckpt.files == [str(f) for f in shard_files(copy)]
    assert set(ckpt.keys()) == set(weight_map(directory))


def hf_cache_layout(directory, root) -> Path:
    """The Hugging Face cache: every file of the snapshot is a relative link into blobs/."""
    repo = Path(root) / "models--tiny--llama"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(Path(directory).iterdir())):
        blob = blobs / f"{i:064x}"  # named by sha256 in the real cache
        shutil.copyfile(f, blob)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / f.name)
    return snapshot


def test_hugging_face_cache_symlinks_load(checkpoint, tmp_path):
    directory, config = checkpoint("llama", "fp32")
    snapshot = hf_cache_layout(directory, tmp_path)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    ref = reference_model("llama", directory, torch.float32)
    for target in (snapshot, index_json(snapshot)):
        model = build_model("llama", config, torch.float32)
        LazyCheckpoint(str(target)).load_into(model, progress=False)
        assert_same_weights(model, ref)


# ------------------------------------------------------------------------ fuzzing

ST_NAMES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"]
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
odd_dims = st.sampled_from([-1, 1.5, True, "2", None, 2**40, 2**64, [1]])
odd_offsets = st.sampled_from([-1, 2.0, False, "0", None, 2**64, [0]])


@st.composite
def tensor_specs(draw):
    """(name, dtype name, shape) of a few tensors, mostly valid."""
    names = draw(st.lists(st.text(min_size=1, max_size=6).filter(lambda s: s != "__metadata__"),
                          max_size=5, unique=True))
    return [(n, draw(st.sampled_from(ST_NAMES)), draw(st.lists(st.integers(0, 4), max_size=3))) for n in names]


@st.composite
def structured_files(draw):
    """File bytes from a valid layout with a few mutations applied, header built by json.dumps."""
    header: dict = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                                                  max_size=3))
    offset = 0
    for name, dt, shape in draw(tensor_specs()):
        if draw(st.integers(0, 9)) == 0:  # now and then an overlap or a gap
            offset = max(0, offset + draw(st.integers(-8, 8)))
        n = math.prod(shape) * ITEMSIZE[dt]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    data_delta, length_delta = 0, 0
    for mutation in draw(st.lists(st.sampled_from(sorted(FILE_MUTATIONS) + sorted(ENTRY_MUTATIONS)), max_size=3)):
        if mutation in FILE_MUTATIONS:
            header, data_delta, length_delta = FILE_MUTATIONS[mutation](draw, header, data_delta, length_delta)
            continue
        keys = [k for k in header if k != "__metadata__"]
        if keys:
            key = draw(st.sampled_from(keys))
            header[key] = ENTRY_MUTATIONS[mutation](draw, header[key])
    # The data ends where the last range ends (so a gap or an overlap is not also a size error)
    data_len = max(0, max((_offsets(v)[1] for v in header.values() if _is_range(v)), default=0) + data_delta)
    raw = json.dumps(header).encode() + b" " * draw(st.integers(0, 7))
    return struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + b"\x5a" * data_len


# (draw, header, data length delta, header length delta) -> the same three, mutated
FILE_MUTATIONS = {
    "data-short": lambda draw, h, n, d: (h, -draw(st.integers(1, 16)), d),
    "data-long": lambda draw, h, n, d: (h, draw(st.integers(1, 16)), d),
    "length-off": lambda draw, h, n, d: (h, n, draw(st.integers(-16, 16))),
    "metadata-json": lambda draw, h, n, d: ({**h, "__metadata__": draw(json_values)}, n, d),
    "reverse-order": lambda draw, h, n, d: (dict(reversed(list(h.items()))), n, d),
}


def _is_range(info) -> bool:
    offsets = _offsets(info)
    return all(type(x) is int for x in offsets) and 0 <= offsets[1] < 1 << 20


def _with(info, field, value):
    return {**info, field: value} if isinstance(info, dict) else info


def _offsets(info) -> list:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    return list(offsets) if isinstance(offsets, list) and len(offsets) == 2 else [0, 0]


def _plus(x, n):
    return x + n if type(x) is int else x  # an earlier mutation may have made it odd


def _shifted(draw, info):
    offsets = _offsets(info)
    i = draw(st.integers(0, 1))
    offsets[i] = _plus(offsets[i], draw(st.integers(-8, 8)))
    return _with(info, "data_offsets", offsets)


def _odd_offset(draw, info):
    offsets = _offsets(info)
    offsets[draw(st.integers(0, 1))] = draw(odd_offsets)
    return _with(info, "data_offsets", offsets)


def _dropped(draw, info):
    if not (isinstance(info, dict) and info):
        return info
    field = draw(st.sampled_from(sorted(info)))
    return {k: v for k, v in info.items() if k != field}


def _shape(info) -> list:
    shape = info.get("shape") if isinstance(info, dict) else None
    return list(shape) if isinstance(shape, list) else []


# (draw, one tensor's header entry) -> the entry, mutated
ENTRY_MUTATIONS = {
    "swap-offsets": lambda draw, info: _with(info, "data_offsets", _offsets(info)[::-1]),
    "shift-offset": _shifted,
    "odd-offset": _odd_offset,
    "drop-field": _dropped,
    "odd-dim": lambda draw, info: _with(info, "shape", [draw(odd_dims)] + _shape(info)[1:]),
    "odd-dtype": lambda draw, info: _with(info, "dtype", draw(st.sampled_from(["Q9", "f32", "", 4, None, ["F32"]]))),
    "entry-json": lambda draw, info: draw(json_values),
    "shape-grow": lambda draw, info: _with(info, "shape", _shape(info) + [draw(st.integers(2, 2**40))]),
    "many-dims": lambda draw, info: _with(info, "shape", [1] * draw(st.integers(0, 64))),
    "rank-65": lambda draw, info: _with(info, "shape", [1] * 65),
    "extra-field": lambda draw, info: _with(info, draw(st.sampled_from(["comment", "x", ""])), draw(json_values)),
}


@st.composite
def byte_mutated_files(draw):
    """A structured file with a few bytes overwritten, inserted or cut."""
    raw = bytearray(draw(structured_files()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["set", "insert", "cut"]))
        if op == "set" and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=4))
        else:
            del raw[at:at + draw(st.integers(1, 8))]
    return bytes(raw)


random_files = st.one_of(
    st.binary(max_size=64),  # anything at all
    st.builds(lambda n, body: struct.pack("<Q", n) + body,  # a random length before random bytes
              st.integers(0, 2**64 - 1) | st.integers(0, 80), st.binary(max_size=64)),
    st.builds(lambda v, pad: file_bytes(json.dumps(v).encode() + b" " * pad), json_values, st.integers(0, 3)),
)


def safetensors_opens(path: str) -> bool:
    try:
        with safe_open(path, "pt") as f:
            f.keys()
        return True
    except Exception:
        return False


_FUZZ_DIR = tempfile.mkdtemp(prefix="lazyload-fuzz-")
atexit.register(shutil.rmtree, _FUZZ_DIR, ignore_errors=True)  # one scratch file for every case, gone after the run


def fuzz_one(raw: bytes, compare: bool) -> None:
    """Index `raw` as a file: a LazyLoadError or an index that tiles the file, nothing else.
    With `compare`, lazyload accepts exactly what safetensors opens."""
    path = os.path.join(_FUZZ_DIR, "f.safetensors")
    with open(path, "wb") as f:
        f.write(raw)
    try:
        idx = CheckpointIndex([path])
    except LazyLoadError as exc:
        assert "f.safetensors" in str(exc)
        ok = False
    else:
        assert_tiles_the_file(path, idx)
        ok = True
    event("accepted" if ok else "refused")  # shown by --hypothesis-show-statistics
    if compare:  # JSON-built headers: no "-0" or lone surrogate, which only Python's json reads
        assert ok == safetensors_opens(path) or (not ok and shape_beyond_torch(raw)), \
            "lazyload and safetensors disagree"


def shape_beyond_torch(raw: bytes) -> bool:
    """lazyload's one rule stricter than safetensors': a shape torch cannot make (over 64
    dims, or a product of its non-zero dims past int64, e.g. [0, 2**40, 2**40])."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    shapes = [info["shape"] for k, info in header.items() if k != "__metadata__"]
    return any(len(s) > 64 or math.prod(max(d, 1) for d in s) >= 2**63 for s in shapes)


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=1000, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@fuzz_settings(700)
@given(structured_files())
def test_fuzz_structured_headers_agree_with_safetensors(raw):
    fuzz_one(raw, compare=True)


@fuzz_settings(700)
@given(byte_mutated_files() | random_files)
def test_fuzz_random_bytes_only_raise_lazyload_errors(raw):
    fuzz_one(raw, compare=False)


@pytest.mark.slow
@fuzz_settings(20_000)
@given(structured_files())
def test_fuzz_structured_headers_agree_with_safetensors_long(raw):
    fuzz_one(raw, compare=True)


@pytest.mark.slow
@fuzz_settings(20_000)
@given(byte_mutated_files() | random_files)
def test_fuzz_random_bytes_only_raise_lazyload_errors_long(raw):
    fuzz_one(raw, compare=False)


# ------------------------------------------------------- config.json of a quantized checkpoint
# Its quantization_config (as compressed-tensors and transformers' FP8 write it) with fields
# of the wrong type, or config.json nested deeper than Python's json can parse.
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A bf16 Llama's directory ("bf16"), it as int8 compressed-tensors per group of 32
    ("ct") and as FP8 blocks of 32 x 32 ("fp8"), and its config ("config")."""
    from checkpoints import write_checkpoint
    from quant_checkpoints import write_compressed_checkpoint, write_fp8_checkpoint

    src, config = write_checkpoint("llama", "bf16", tmp_path_factory.mktemp("llama"))
    return {"bf16": src, "config": config,
            "ct": write_compressed_checkpoint(src, tmp_path_factory.mktemp("ct") / "ct", "int", "group", 32),
            "fp8": write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8") / "fp8", (32, 32))}


def _with_config(source, tmp_path, edit) -> Path:
    """A copy of `source` whose config.json's quantization_config `edit(q)` changed."""
    directory = copy_checkpoint(source, tmp_path / "bad")
    config = json.loads((directory / "config.json").read_text())
    edit(config["quantization_config"])
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _group(q) -> dict:
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize("kind, edit, field", [
    ("ct", lambda q: q.update(config_groups=["group_0"]), "config_groups is ['group_0']"),
    ("ct", lambda q: q.update(config_groups="group_0"), "config_groups is 'group_0'"),
    ("ct", lambda q: q["config_groups"].update(group_0=["Linear"]), "config_groups.group_0 is ['Linear']"),
    ("ct", lambda q: _group(q).update(weights=[8]), "config_groups.group_0 is {"),
    ("ct", lambda q: _group(q)["weights"].update(group_size="32"), "group_0.weights.group_size is '32'"),
    ("ct", lambda q: _group(q)["weights"].update(group_size=0), "group_0.weights.group_size is 0"),
    ("ct", lambda q: _group(q)["weights"].update(group_size=10 ** 4000), "group_size is <integer of"),
    ("ct", lambda q: _group(q)["weights"].update(strategy="block"), "block_structure is None"),
    ("fp8", lambda q: q.update(weight_block_size=32), "weight_block_size is 32"),
    ("fp8", lambda q: q.update(weight_block_size=["32", "32"]), "weight_block_size is ['32', '32']"),
    ("fp8", lambda q: q.update(weight_block_size=[0, 32]), "weight_block_size is [0, 32]"),
], ids=["groups-list", "groups-str", "group-list", "weights-list", "group-size-str", "group-size-0",
        "group-size-huge", "block-structure-none", "block-size-int", "block-size-strs", "block-size-0"])
def test_quantization_config_of_the_wrong_type(quantized, tmp_path, kind, edit, field):
    """A CheckpointError naming config.json and the field, never AttributeError, TypeError,
    ValueError or ZeroDivisionError, before any tensor byte is read."""
    directory = _with_config(quantized[kind], tmp_path, edit)
    model = build_model("llama", quantized["config"], torch.bfloat16)
    with pytest.raises(CheckpointError, match="config.json: quantization_config") as info:
        LazyCheckpoint(str(directory)).load_into(model, progress=False)
    assert field in str(info.value) and len(str(info.value)) < 1000, str(info.value)
    assert all(t.is_meta for t in model.state_dict().values())


def test_config_json_nested_too_deep(quantized, tmp_path, caplog):
    """config.json nested deeper than Python's json parses: the quantized weights are found
    from the tensors alone (as for any unreadable config.json, with a warning), and a model
    built from it is an ArgumentError naming the file: no RecursionError either way."""
    directory = copy_checkpoint(quantized["fp8"], tmp_path / "deep")
    (directory / "config.json").write_text('{"quantization_config": ' + DEEP + "}")
    model = build_model("llama", quantized["config"], torch.bfloat16)
    with caplog.at_level("WARNING", logger="lazyload"):
        with pytest.raises(CheckpointError, match="cannot tell the block size"):  # 32 x 32 blocks, undeclared
            LazyCheckpoint(str(directory)).load_into(model, progress=False)
    assert "config.json: not read" in caplog.text
    (directory / "config.json").write_text('{"model_type": "llama", "a": ' + "[" * 900 + "]" * 900 + "}")
    with pytest.raises(ArgumentError, match="config.json: not a config transformers can read"):
        load_model(str(directory))


def test_save_sharded_refuses_a_source_config_json_it_cannot_parse(quantized, tmp_path):
    """The writer adds quantization_config to the source's config.json: one nested too deep
    to parse is a CheckpointError naming the source, and nothing is written."""
    directory = copy_checkpoint(quantized["bf16"], tmp_path / "src")
    (directory / "config.json").write_text(DEEP)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="its config.json is not valid JSON") as info:
        save_sharded(str(directory), str(out), 1, model=build_model("llama", quantized["config"], torch.float32),
                     quantize=Quantization("int8", group_size=32))
    assert str(directory) in str(info.value) and not out.exists()


@pytest.mark.parametrize("text", ["[1]", DEEP], ids=["a-list", "nested-deep"])
def test_mismatch_hint_survives_a_config_json_it_cannot_read(quantized, tmp_path, text):
    """A model that does not fit the checkpoint: its MappingError is raised as it is when
    the config.json the hint compares with is no object, or too deep to parse."""
    directory = copy_checkpoint(quantized["bf16"], tmp_path / "src")
    (directory / "config.json").write_text(text)
    config = quantized["config"].__class__(**{**quantized["config"].to_dict(), "vocab_size": 300})
    with pytest.raises(ShapeMismatchError):
        LazyCheckpoint(str(directory)).load_into(build_model("llama", config, torch.bfloat16), progress=False)
