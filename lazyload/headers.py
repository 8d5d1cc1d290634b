"""The safetensors header parser: a file's header (8-byte little-endian length, then JSON)
read and checked into tensor entries, strict JSON for the small files that describe a
checkpoint, and an index json's weight_map.

safetensors' Python API exposes keys, dtypes and shapes but not byte offsets, which the
planner and the pread reader need; the header format is a documented, stable spec, so it is
parsed here directly. Every header field is untrusted input: each is type-checked, and a
file whose header does not describe it exactly is refused (`CheckpointError`) before any
tensor byte is read. Public surface: `read_header`, `header_length`, `entries_of_header`,
`entries_of_file`, `TensorEntry`, `FileIdentity`, `DTYPES`, `MAX_HEADER`, `load_json`,
`read_json`, `read_weight_map`, `weight_map_of`, `check_weight_map`, `files_from_index_json`.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, BinaryIO, Callable, Mapping as MappingT, TypeVar

import torch

from .errors import CheckpointError, shown

# safetensors dtype names -> torch dtypes (only those this torch build has).
DTYPES: dict[str, torch.dtype] = {
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
        DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER = 100_000_000  # safetensors' own limit, in bytes; also caps an index json
_MAX_RANK = 64  # far above any real tensor; refuses shapes of 100000 dims
MAX_INT64 = 2**63 - 1  # torch sizes and strides are int64
_CORRUPT = "the file is corrupt or not safetensors; re-download or re-save it."


@dataclass(frozen=True)
class FileIdentity:
    """What a file was when its header was read (`os.stat`): a reader opening it later
    compares, so that a file replaced, truncated or rewritten since is refused instead of
    read as if its header still described it."""

    size: int
    inode: int
    device: int
    mtime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> "FileIdentity":
        return cls(info.st_size, info.st_ino, info.st_dev, info.st_mtime_ns)


@dataclass(frozen=True, slots=True)  # one per stored key; a sync target's index holds thousands
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


T = TypeVar("T")


def _read_regular(path: str, read: Callable[[BinaryIO, int], T]) -> T:
    """read(f, size) on `path`; OSError and anything but a regular file (a FIFO would
    block, a directory has no bytes) become CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without waiting
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path}: not a regular file; point lazyload at .safetensors files "
                                      "or the directory holding them.")
            return read(f, info.st_size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc}); check the path and permissions.") from exc


def _unique_keys(path: str, pairs: list[tuple[str, Any]]) -> dict:
    """object_pairs_hook: json.loads would silently keep the last of two equal keys."""
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise CheckpointError(f"{path}: key {shown(key)} appears twice in one JSON object (a tensor or field "
                                  "given twice; which one is meant is unknowable); re-download or re-save it.")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN/Infinity; safetensors does not


def load_json(path: str, raw: bytes, what: str) -> Any:
    """Parse `raw` as strict JSON: UTF-8 (json.loads would also guess UTF-16/32), no
    NaN/Infinity, no repeated key in an object."""
    def unique(pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)  # in C; the checking loop only when a key was dropped
        return obj if len(obj) == len(pairs) else _unique_keys(path, pairs)

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: {what} is not UTF-8 ({exc.reason} at byte {exc.start}); the file is "
                              "corrupt, re-download or re-save it.") from exc
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting thousands deep
        raise CheckpointError(f"{path}: {what} is not valid JSON ({shown(str(exc))}); the file is corrupt, "
                              "re-download or re-save it.") from exc


def _json_type(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _is_utf8(text: str) -> bool:
    """False for strings holding lone surrogates (JSON escapes like \\ud800), which cannot be printed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def header_length(path: str, raw: bytes, size: int) -> int:
    """The header length the first 8 bytes `raw` of a `size`-byte file announce, checked
    before the header is read: a tiny file may claim a 99 MB header."""
    if len(raw) != 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file ({len(raw)} bytes); "
                              "re-download or re-save it.")
    (length,) = struct.unpack("<Q", raw)
    if not 2 <= length <= MAX_HEADER:  # "{}" is the smallest header
        raise CheckpointError(f"{path}: header length {length} is implausible; {_CORRUPT}")
    if 8 + length > size:
        raise CheckpointError(f"{path}: header length {length} runs past the end of the file ({size} bytes); "
                              "the file is truncated or not safetensors.")
    return length


def read_header(path: str) -> tuple[dict, int, FileIdentity]:
    """Return (header dict, data start offset, identity) of one safetensors file."""

    def read(f: BinaryIO, size: int) -> tuple[bytes, FileIdentity]:
        length = header_length(path, f.read(8), size)
        text = f.read(length)
        if len(text) != length:
            raise CheckpointError(f"{path}: truncated header ({len(text)} of {length} bytes); the file changed "
                                  "while being read.")
        return text, FileIdentity.of(os.fstat(f.fileno()))

    text, identity = _read_regular(path, read)
    return _parse_header(path, text), 8 + len(text), identity


def _parse_header(path: str, text: bytes) -> dict:
    header = load_json(path, text, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {_json_type(header)}, not an object; {_CORRUPT}")
    return header


def entries_of_file(path: str) -> tuple[list[TensorEntry], int, FileIdentity]:
    header, data_start, identity = read_header(path)
    return entries_of_header(path, header, data_start, identity.size), data_start, identity


def entries_of_header(path: str, header: dict | bytes, data_start: int, size: int) -> list[TensorEntry]:
    """The checked entries of a header (its dict, or its JSON bytes) of a `size`-byte file."""
    if isinstance(header, bytes):
        header = _parse_header(path, header)
    _check_metadata(path, header.get("__metadata__"))
    entries = [_entry(path, key, info, data_start) for key, info in header.items() if key != "__metadata__"]
    _check_layout(path, entries, data_start, size)
    return entries


def _check_metadata(path: str, metadata: Any) -> None:
    """safetensors allows null or an object of strings."""
    if metadata is None:
        return
    if not (isinstance(metadata, dict) and all(isinstance(v, str) and _is_utf8(k) and _is_utf8(v)
                                               for k, v in metadata.items())):
        raise CheckpointError(f"{path}: __metadata__ is {shown(metadata)}, not an object of strings; "
                              f"safetensors refuses it too, {_CORRUPT}")


def _is_size(value: Any) -> bool:
    """A non-negative int (bool is an int in Python, not in JSON)."""
    return type(value) is int and value >= 0


def _is_shape(shape: Any) -> bool:
    """torch refuses sizes whose product (zeros aside: they still count in strides) passes
    int64, e.g. [0, 2**40, 2**40]; no real tensor has more than a handful of dims."""
    return (isinstance(shape, list) and len(shape) <= _MAX_RANK and all(_is_size(d) for d in shape)
            and math.prod(max(d, 1) for d in shape) <= MAX_INT64)


def _entry(path: str, key: str, info: Any, data_start: int) -> TensorEntry:
    """One tensor's header entry, every field type-checked: the header is untrusted input.
    The checks of a well-formed entry in one expression (100k entries in a large
    checkpoint); anything else goes through `_checked_entry`, which says what is wrong."""
    if type(info) is dict:
        name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = DTYPES.get(name) if type(name) is str else None
        if (dtype is not None and type(shape) is list and len(shape) <= _MAX_RANK
                and all(type(d) is int and d >= 0 for d in shape) and type(offsets) is list and len(offsets) == 2
                and type(offsets[0]) is int and type(offsets[1]) is int and 0 <= offsets[0] <= offsets[1]
                and math.prod(shape) * dtype.itemsize == offsets[1] - offsets[0]
                and (offsets[1] - offsets[0] or _is_shape(shape)) and offsets[1] - offsets[0] <= MAX_INT64
                and _is_utf8(key)):
            return TensorEntry(path, key, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    return _checked_entry(path, key, info, data_start)


def _checked_entry(path: str, key: str, info: Any, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {shown(key)}"
    if not _is_utf8(key):
        raise CheckpointError(f"{where}: the name holds an unpaired UTF-16 surrogate; {_CORRUPT}")
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is described by a JSON {_json_type(info)}, not an object with dtype, "
                              f"shape and data_offsets; {_CORRUPT}")
    missing = [field for field in ("dtype", "shape", "data_offsets") if field not in info]
    if missing:
        raise CheckpointError(f"{where} has no {' or '.join(missing)}; {_CORRUPT}")
    name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointError(f"{where} has dtype {shown(name)}, which lazyload cannot read "
                              f"(known: {', '.join(sorted(DTYPES))}); convert the checkpoint.")
    if not _is_shape(shape):
        raise CheckpointError(f"{where} has shape {shown(shape)}; lazyload takes a list of at most {_MAX_RANK} "
                              f"non-negative integers whose product, zeros aside, fits torch's int64 sizes; {_CORRUPT}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(x) for x in offsets)):
        raise CheckpointError(f"{where} has data_offsets {shown(offsets)}; they must be two non-negative "
                              f"integers [begin, end]; {_CORRUPT}")
    begin, stop = offsets
    if begin > stop:
        raise CheckpointError(f"{where} has data_offsets [{begin}, {stop}], which end before they begin; {_CORRUPT}")
    needed = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if stop - begin != needed:
        raise CheckpointError(f"{where} spans {stop - begin} bytes but shape {shown(shape)} of {name} needs "
                              f"{needed}; {_CORRUPT}")
    return TensorEntry(path, key, dtype, tuple(shape), data_start + begin, data_start + stop)


def _check_layout(path: str, entries: list[TensorEntry], data_start: int, size: int) -> None:
    """safetensors' own rule: in offset order the tensors tile the data exactly, from the
    header's end to the file's end: no byte past the end, no overlap, no gap."""
    last = max(entries, key=attrgetter("end"), default=None)
    if last is not None and last.end > size:
        raise CheckpointError(f"{path}: tensor {shown(last.key)} ends at byte {last.end}, past the end of the file "
                              f"({size} bytes); the file is truncated (re-download it).")
    end, prev = data_start, None
    for e in sorted(entries, key=attrgetter("start", "end")):
        if e.start < end:
            raise CheckpointError(f"{path}: tensor {shown(e.key)} (bytes {e.start}..{e.end}) overlaps tensor "
                                  f"{shown(prev.key)} (bytes {prev.start}..{prev.end}); {_CORRUPT}")
        if e.start > end:
            raise CheckpointError(f"{path}: bytes {end}..{e.start} before tensor {shown(e.key)} belong to no tensor "
                                  f"(safetensors allows no gap); {_CORRUPT}")
        end, prev = e.end, e
    if end != size:
        raise CheckpointError(f"{path}: bytes {end}..{size} at the end of the file belong to no tensor "
                              f"(safetensors allows none); {_CORRUPT}")


def files_from_index_json(index_json: str) -> list[str]:
    folder = os.path.dirname(index_json)
    files = sorted(os.path.join(folder, name) for name in set(read_weight_map(index_json).values()))
    for f in files:
        if not os.path.isfile(f):  # follows symlinks: the Hugging Face cache links shards into blobs/
            raise CheckpointError(f"{index_json} names {os.path.relpath(f, folder or '.')}, which is missing "
                                  f"from {folder or '.'} (or not a regular file).")
    return files


def read_json(path: str, what: str) -> Any:
    """A small JSON file (an index or a checkpoint description), parsed strictly."""

    def read(f: BinaryIO, size: int) -> bytes:
        if size > MAX_HEADER:
            raise CheckpointError(f"{path}: {size} bytes, too big for {what}; it is not one.")
        return f.read()

    return load_json(path, _read_regular(path, read), what)


def read_weight_map(index_json: str) -> dict[str, str]:
    """The index json's weight_map, key -> shard name, each name normalized and inside the
    index json's directory (the name only: the file may be a symlink to anywhere)."""
    return weight_map_of(index_json, read_json(index_json, "index json"))


def weight_map_of(index_json: str, doc: Any) -> dict[str, str]:
    """The checked weight_map of a parsed index json `doc`."""
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_json}: no 'weight_map' object (found {shown(weight_map)}); this is not a "
                              "safetensors index json, re-download or re-save the checkpoint.")
    normalized: dict[str, str] = {}  # a few hundred shard names for 100k keys: each checked once
    out = {}
    for key, name in weight_map.items():
        norm = normalized.get(name) if isinstance(name, str) else None
        if norm is None or not _is_utf8(key):
            norm = _shard_name(index_json, key, name)
            normalized[name] = norm
        out[key] = norm
    return out


def _shard_name(index_json: str, key: str, name: Any) -> str:
    """`name` normalized, refused unless a relative path that stays inside the directory."""
    norm = os.path.normpath(name) if isinstance(name, str) and name and "\0" not in name else None
    if (norm is None or not _is_utf8(key) or not _is_utf8(norm) or os.path.isabs(norm)
            or norm in (os.curdir, os.pardir) or norm.startswith(os.pardir + os.sep)):
        raise CheckpointError(f"{index_json}: weight_map entry {shown(key)} names {shown(name)}, which is not a "
                              "file inside the index json's directory; shard names must be relative and stay "
                              "inside it (fix or re-download the index json).")
    return norm


def check_weight_map(index_json: str, files: MappingT[str, str], entries: MappingT[str, TensorEntry],
                     same_file: Callable[[str, str], bool]) -> None:
    """Every key of the index json (key -> the file it names) is stored in that file."""
    for key, expected in files.items():
        entry = entries.get(key)
        if entry is None:
            raise CheckpointError(f"{index_json} lists {key!r} in {expected}, but that file has no such "
                                  "tensor; the index json and the shards disagree (re-save the checkpoint).")
        if not same_file(entry.file, expected):
            raise CheckpointError(f"{index_json} lists {key!r} in {expected}, but it is stored in "
                                  f"{entry.file}; the index json and the shards disagree.")
