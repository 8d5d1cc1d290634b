"""Index: every tensor of every checkpoint file, from the safetensors headers alone.

safetensors' Python API exposes keys, dtypes and shapes but not byte offsets, which the
planner and the pread reader need; the header format (8-byte little-endian length, then
JSON) is a documented, stable spec, so it is parsed here directly.

Other formats (`formats/`: pre-sharded layouts, `.bin`/`.pt`, Megatron, DeepSpeed) build the
same index from their own metadata (`CheckpointIndex.of`). A tensor they store in pieces
(one per source tensor-parallel rank) is one logical name whose expression concatenates the
pieces; the Mapping stage sees names (`names`, `expr`), the Plan reads stored entries.
"""
from __future__ import annotations

import copy
import glob
import json
import math
import os
import re
import reprlib
import stat
import struct
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, BinaryIO, Callable, Collection, Iterable, Iterator, Mapping as MappingT, Sequence, TypeVar

import torch

from .errors import CheckpointError
from .expr import Expr, Source

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
_MAX_HEADER = 100_000_000  # safetensors' own limit, in bytes; also caps an index json
_MAX_RANK = 64  # far above any real tensor; refuses shapes of 100000 dims
_MAX_INT64 = 2**63 - 1  # torch sizes and strides are int64

_repr = reprlib.Repr()  # hostile values (a 100000-dim shape, a 1 MB string) stay short in messages
_repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxlong = 8, 4, 200, 40
_short = _repr.repr
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


T = TypeVar("T")

_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> list:
    """Sort 'layers.10' after 'layers.9' (experts must stack in index order): the digit
    runs (odd places of the split) compare as numbers."""
    parts: list = _DIGITS.split(key)
    parts[1::2] = map(int, parts[1::2])
    return parts


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
            raise CheckpointError(f"{path}: key {_short(key)} appears twice in one JSON object (a tensor or field "
                                  "given twice; which one is meant is unknowable); re-download or re-save it.")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN/Infinity; safetensors does not


def _load_json(path: str, raw: bytes, what: str) -> Any:
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
        raise CheckpointError(f"{path}: {what} is not valid JSON ({_short(str(exc))}); the file is corrupt, "
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
    if not 2 <= length <= _MAX_HEADER:  # "{}" is the smallest header
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
    header = _load_json(path, text, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {_json_type(header)}, not an object; {_CORRUPT}")
    return header


def _entries_of_file(path: str) -> tuple[list[TensorEntry], int, FileIdentity]:
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
        raise CheckpointError(f"{path}: __metadata__ is {_short(metadata)}, not an object of strings; "
                              f"safetensors refuses it too, {_CORRUPT}")


def _is_size(value: Any) -> bool:
    """A non-negative int (bool is an int in Python, not in JSON)."""
    return type(value) is int and value >= 0


def _is_shape(shape: Any) -> bool:
    """torch refuses sizes whose product (zeros aside: they still count in strides) passes
    int64, e.g. [0, 2**40, 2**40]; no real tensor has more than a handful of dims."""
    return (isinstance(shape, list) and len(shape) <= _MAX_RANK and all(_is_size(d) for d in shape)
            and math.prod(max(d, 1) for d in shape) <= _MAX_INT64)


def _entry(path: str, key: str, info: Any, data_start: int) -> TensorEntry:
    """One tensor's header entry, every field type-checked: the header is untrusted input.
    The checks of a well-formed entry in one expression (100k entries in a large
    checkpoint); anything else goes through `_checked_entry`, which says what is wrong."""
    if type(info) is dict:
        name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = _DTYPES.get(name) if type(name) is str else None
        if (dtype is not None and type(shape) is list and len(shape) <= _MAX_RANK
                and all(type(d) is int and d >= 0 for d in shape) and type(offsets) is list and len(offsets) == 2
                and type(offsets[0]) is int and type(offsets[1]) is int and 0 <= offsets[0] <= offsets[1]
                and math.prod(shape) * dtype.itemsize == offsets[1] - offsets[0]
                and (offsets[1] - offsets[0] or _is_shape(shape)) and offsets[1] - offsets[0] <= _MAX_INT64
                and _is_utf8(key)):
            return TensorEntry(path, key, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    return _checked_entry(path, key, info, data_start)


def _checked_entry(path: str, key: str, info: Any, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {_short(key)}"
    if not _is_utf8(key):
        raise CheckpointError(f"{where}: the name holds an unpaired UTF-16 surrogate; {_CORRUPT}")
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is described by a JSON {_json_type(info)}, not an object with dtype, "
                              f"shape and data_offsets; {_CORRUPT}")
    missing = [field for field in ("dtype", "shape", "data_offsets") if field not in info]
    if missing:
        raise CheckpointError(f"{where} has no {' or '.join(missing)}; {_CORRUPT}")
    name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointError(f"{where} has dtype {_short(name)}, which lazyload cannot read "
                              f"(known: {', '.join(sorted(_DTYPES))}); convert the checkpoint.")
    if not _is_shape(shape):
        raise CheckpointError(f"{where} has shape {_short(shape)}; lazyload takes a list of at most {_MAX_RANK} "
                              f"non-negative integers whose product, zeros aside, fits torch's int64 sizes; {_CORRUPT}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(x) for x in offsets)):
        raise CheckpointError(f"{where} has data_offsets {_short(offsets)}; they must be two non-negative "
                              f"integers [begin, end]; {_CORRUPT}")
    begin, stop = offsets
    if begin > stop:
        raise CheckpointError(f"{where} has data_offsets [{begin}, {stop}], which end before they begin; {_CORRUPT}")
    needed = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if stop - begin != needed:
        raise CheckpointError(f"{where} spans {stop - begin} bytes but shape {_short(shape)} of {name} needs "
                              f"{needed}; {_CORRUPT}")
    return TensorEntry(path, key, dtype, tuple(shape), data_start + begin, data_start + stop)


def _check_layout(path: str, entries: list[TensorEntry], data_start: int, size: int) -> None:
    """safetensors' own rule: in offset order the tensors tile the data exactly, from the
    header's end to the file's end: no byte past the end, no overlap, no gap."""
    last = max(entries, key=attrgetter("end"), default=None)
    if last is not None and last.end > size:
        raise CheckpointError(f"{path}: tensor {_short(last.key)} ends at byte {last.end}, past the end of the file "
                              f"({size} bytes); the file is truncated (re-download it).")
    end, prev = data_start, None
    for e in sorted(entries, key=attrgetter("start", "end")):
        if e.start < end:
            raise CheckpointError(f"{path}: tensor {_short(e.key)} (bytes {e.start}..{e.end}) overlaps tensor "
                                  f"{_short(prev.key)} (bytes {prev.start}..{prev.end}); {_CORRUPT}")
        if e.start > end:
            raise CheckpointError(f"{path}: bytes {end}..{e.start} before tensor {_short(e.key)} belong to no tensor "
                                  f"(safetensors allows no gap); {_CORRUPT}")
        end, prev = e.end, e
    if end != size:
        raise CheckpointError(f"{path}: bytes {end}..{size} at the end of the file belong to no tensor "
                              f"(safetensors allows none); {_CORRUPT}")


def resolve_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[list[str], str | None]:
    """Turn a directory, a file, an index json, a glob or a list of files into (files, index json or None)."""
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
        if os.path.isfile(path) and path.endswith(".index.json"):  # the checkpoint it indexes is meant
            return _files_from_index_json(path), path
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
            raise CheckpointError(f"{f}: no such file (or not a regular file); pass .safetensors files.")
    return files, None


def _files_from_index_json(index_json: str) -> list[str]:
    folder = os.path.dirname(index_json)
    files = sorted(os.path.join(folder, name) for name in set(_weight_map(index_json).values()))
    for f in files:
        if not os.path.isfile(f):  # follows symlinks: the Hugging Face cache links shards into blobs/
            raise CheckpointError(f"{index_json} names {os.path.relpath(f, folder or '.')}, which is missing "
                                  f"from {folder or '.'} (or not a regular file).")
    return files


def read_json(path: str, what: str) -> Any:
    """A small JSON file (an index or a checkpoint description), parsed strictly."""

    def read(f: BinaryIO, size: int) -> bytes:
        if size > _MAX_HEADER:
            raise CheckpointError(f"{path}: {size} bytes, too big for {what}; it is not one.")
        return f.read()

    return _load_json(path, _read_regular(path, read), what)


def _weight_map(index_json: str) -> dict[str, str]:
    """The index json's weight_map, key -> shard name, each name normalized and inside the
    index json's directory (the name only: the file may be a symlink to anywhere)."""
    return weight_map_of(index_json, read_json(index_json, "index json"))


def weight_map_of(index_json: str, doc: Any) -> dict[str, str]:
    """The checked weight_map of a parsed index json `doc`."""
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_json}: no 'weight_map' object (found {_short(weight_map)}); this is not a "
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
        raise CheckpointError(f"{index_json}: weight_map entry {_short(key)} names {_short(name)}, which is not a "
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


class CheckpointIndex(MappingABC):
    """key -> TensorEntry for every stored tensor of the checkpoint, built from headers only.

    The checkpoint's tensors as a model sees them are `names()`: each stored key, except
    that the pieces of a tensor split across files appear once, as their logical name, whose
    `expr` concatenates them (a `Layout` from `formats/`)."""

    def __init__(self, files: Iterable[str], index_json: str | None = None):
        self._start(files, index_json)
        for path in self.files:
            entries, data_start, self.identities[path] = _entries_of_file(path)
            self.header_bytes_read += data_start
            self._add((entry.key, entry) for entry in entries)
        if index_json is not None:
            self._check_against_index_json(index_json)

    @classmethod
    def of(cls, files: Iterable[str], entries: Iterable[tuple[str, TensorEntry]], layouts: MappingT[str, Any] | None = None,
           header_bytes_read: int = 0, description: str | None = None,
           identities: MappingT[str, FileIdentity] | None = None) -> "CheckpointIndex":
        """An index a format built: stored entries keyed by their unique key (`entry.key` is
        the name inside its file; pairs (key, entry)), and logical tensors `name -> Layout` over those keys."""
        index = cls.__new__(cls)
        index._start(files, description)
        index.header_bytes_read = header_bytes_read
        index.identities = dict(identities or {})  # files the readers check are unchanged when read
        index._add(entries)
        index._layouts = dict(layouts or {})
        for name, layout in index._layouts.items():
            for key in layout.keys():
                if key not in index._entries:
                    raise CheckpointError(f"{description or name}: logical tensor {name!r} names the piece {key!r}, "
                                          "which no file stores; the checkpoint description and its files disagree.")
                index._owner[key] = name
        index._exprs = {name: layout.expr() for name, layout in index._layouts.items()}
        return index

    def _start(self, files: Iterable[str], index_json: str | None) -> None:
        self.files = list(files)
        self.index_json = index_json
        self.header_bytes_read = 0
        self._entries: dict[str, TensorEntry] = {}
        self.identities: dict[str, FileIdentity] = {}  # path -> the file as indexed
        self._layouts: dict[str, Any] = {}
        self._exprs: dict[str, Expr] = {}
        self._owner: dict[str, str] = {}  # stored key -> the logical name it is a piece of
        self._natural: tuple[Collection[str], list[str]] | None = None  # (left out, natural_names())

    def _add(self, entries: Iterable[tuple[str, TensorEntry]]) -> None:
        for key, entry in entries:
            other = self._entries.get(key)
            if other is not None:
                raise CheckpointError(f"tensor {key!r} is stored twice: in {other.file} and in "
                                      f"{entry.file}; remove one of the files from the checkpoint.")
            self._entries[key] = entry

    def _check_against_index_json(self, index_json: str) -> None:
        folder = os.path.dirname(index_json)
        weight_map = _weight_map(index_json)
        paths = {name: os.path.join(folder, name) for name in set(weight_map.values())}  # once per file
        check_weight_map(index_json, {key: paths[name] for key, name in weight_map.items()}, self._entries,
                         lambda a, b: a == b or os.path.abspath(a) == os.path.abspath(b))

    def __getitem__(self, key: str) -> TensorEntry:
        return self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:  # a dict lookup, not Mapping's try/except around __getitem__
        return key in self._entries

    def keys(self):  # the dict's own view: fast iteration and membership
        return self._entries.keys()

    def items(self):  # the dict's own view: no lookup per key
        return self._entries.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries.values())

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # The checkpoint's tensors as the Mapping stage sees them.

    def names(self) -> list[str]:
        """Every tensor name: stored keys that are whole tensors, and logical names."""
        return [k for k in self._entries if k not in self._owner] + list(self._layouts)

    def natural_names(self, leaving_out: Collection[str] = frozenset()) -> list[str]:
        """`names()` less `leaving_out`, in `natural_key` order; sorted once for the last set
        asked (both mapping passes leave out the same scale siblings, DeepSeek-V3's half of
        its 92k keys: 46k names sort in ~0.1 s)."""
        if self._natural is None or self._natural[0] is not leaving_out:
            names = [n for n in dict.fromkeys(self.names()) if n not in leaving_out]
            self._natural = (leaving_out, sorted(names, key=natural_key))
        return self._natural[1]

    def expr(self, name: str) -> Expr:
        return self._exprs.get(name) or Source(name)

    def shape(self, name: str) -> tuple[int, ...]:
        layout = self._layouts.get(name)
        return layout.shape if layout is not None else self._entries[name].shape

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The shape of stored key `key`: what expressions are pushed down with (an
        expression remembers shapes per index: `index.shape_of == index.shape_of`)."""
        return self._entries[key].shape

    def name_of(self, key: str) -> str:
        """The name a stored key belongs to (a piece's logical name, else the key)."""
        return self._owner.get(key, key)

    def files_of(self, name: str) -> list[str]:
        keys = self.expr(name).keys()
        return sorted({self._entries[k].file for k in keys})

    def for_rank(self, rank: int, world: int) -> "CheckpointIndex":
        """This index with each logical tensor's copies (a replicated tensor stored in every
        source rank's file) taken from the file of the source rank nearest to `rank` of
        `world`: at the world a checkpoint was sharded for, each rank reads its own file."""
        if not self._layouts:
            return self
        index = copy.copy(self)
        index._exprs = {name: layout.expr(rank, world) for name, layout in self._layouts.items()}
        return index
