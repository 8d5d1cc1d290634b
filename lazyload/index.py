"""Index: every tensor of every checkpoint file, from the safetensors headers alone.

safetensors' Python API exposes keys, dtypes and shapes but not byte offsets, which the
planner and the pread reader need; the header format (8-byte little-endian length, then
JSON) is a documented, stable spec, so it is parsed here directly.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from .errors import CheckpointError

# safetensors dtype names -> torch dtypes (only those this torch build has).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

INDEX_JSON = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one file: where its bytes are, and what they are."""

    file: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def read_header(path: str) -> tuple[dict, int]:
    """Return (header dict, data start offset) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file ({len(raw)} bytes); "
                                      "re-download or re-save it.")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise CheckpointError(f"{path}: header length {length} is implausible; the file is not "
                                      "safetensors or is corrupt.")
            text = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror}); check the path and permissions.") from exc
    if len(text) != length:
        raise CheckpointError(f"{path}: truncated header ({len(text)} of {length} bytes); the file is incomplete.")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}); the file is not safetensors.") from exc
    return header, 8 + length


def _entries_of_file(path: str) -> tuple[list[TensorEntry], int]:
    header, data_start = read_header(path)
    size = os.path.getsize(path)
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {info.get('dtype')!r}, which lazyload "
                                  f"cannot read (known: {', '.join(sorted(_DTYPES))}); convert the checkpoint.")
        shape = tuple(int(d) for d in info["shape"])
        begin, stop = (int(x) for x in info["data_offsets"])
        start, end = data_start + begin, data_start + stop
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {key!r} spans {stop - begin} bytes but shape {list(shape)} "
                                  f"of {info['dtype']} needs {math.prod(shape) * dtype.itemsize}; the file is corrupt.")
        if end > size:
            raise CheckpointError(f"{path}: tensor {key!r} ends at byte {end}, past the end of the file "
                                  f"({size} bytes); the file is truncated.")
        entries.append(TensorEntry(path, key, dtype, shape, start, end))
    return entries, data_start


def resolve_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[list[str], str | None]:
    """Turn a directory, a file, a glob or a list of files into (files, index json or None)."""
    if isinstance(paths, (str, os.PathLike)):
        path = os.fspath(paths)
        if os.path.isdir(path):
            index_json = os.path.join(path, INDEX_JSON)
            if os.path.exists(index_json):
                return _files_from_index_json(index_json), index_json
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise CheckpointError(f"{path}: directory holds no *.safetensors file and no {INDEX_JSON}.")
            return files, None
        if os.path.isfile(path):
            return [path], None
        files = sorted(glob.glob(path))
        if not files:
            raise CheckpointError(f"{path}: no such file or directory, and no file matches it as a glob.")
        return files, None
    files = [os.fspath(p) for p in paths]
    if not files:
        raise CheckpointError("an empty list of checkpoint files was given; pass at least one .safetensors file.")
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: no such file.")
    return files, None


def _files_from_index_json(index_json: str) -> list[str]:
    weight_map = _weight_map(index_json)
    folder = os.path.dirname(index_json)
    files = sorted({os.path.join(folder, name) for name in weight_map.values()})
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"{index_json} names {os.path.basename(f)}, which is missing from {folder}.")
    return files


def _weight_map(index_json: str) -> dict[str, str]:
    try:
        with open(index_json) as f:
            return dict(json.load(f)["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_json}: unreadable or has no 'weight_map' ({exc}).") from exc


class CheckpointIndex(MappingABC):
    """key -> TensorEntry for every tensor of the checkpoint, built from headers only."""

    def __init__(self, files: Iterable[str], index_json: str | None = None):
        self.files = list(files)
        self.index_json = index_json
        self.header_bytes_read = 0
        self._entries: dict[str, TensorEntry] = {}
        for path in self.files:
            entries, data_start = _entries_of_file(path)
            self.header_bytes_read += data_start
            for entry in entries:
                other = self._entries.get(entry.key)
                if other is not None:
                    raise CheckpointError(f"tensor {entry.key!r} is stored twice: in {other.file} and in "
                                          f"{entry.file}; remove one of the files from the checkpoint.")
                self._entries[entry.key] = entry
        if index_json is not None:
            self._check_against_index_json(index_json)

    def _check_against_index_json(self, index_json: str) -> None:
        folder = os.path.dirname(index_json)
        for key, name in _weight_map(index_json).items():
            entry = self._entries.get(key)
            expected = os.path.join(folder, name)
            if entry is None:
                raise CheckpointError(f"{index_json} lists {key!r} in {expected}, but that file has no such "
                                      "tensor; the index json and the shards disagree (re-save the checkpoint).")
            if os.path.abspath(entry.file) != os.path.abspath(expected):
                raise CheckpointError(f"{index_json} lists {key!r} in {expected}, but it is stored in "
                                      f"{entry.file}; the index json and the shards disagree.")

    def __getitem__(self, key: str) -> TensorEntry:
        return self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries.values())

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())
