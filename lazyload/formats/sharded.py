"""lazyload's own pre-sharded layout: one safetensors file per target rank (or per rank and
layer range) and `lazyload_sharded.json`, which records each tensor's global shape and dtype
and, for every piece, the file and key holding it and the box of the tensor it is.

    {"format": "lazyload-sharded", "version": 1, "world": 4,
     "files": [{"name": "rank-00000-of-00004.safetensors", "rank": 0}, ...],
     "tensors": {"model.layers.0.self_attn.q_proj.weight":
                    {"shape": [64, 64], "dtype": "F32",
                     "pieces": [{"file": 0, "key": "model.layers.0.self_attn.q_proj.weight",
                                 "box": [[0, 16], [0, 64]]}, ...]}, ...}}

Inside a rank's file a piece is stored under the tensor's name (`name@N` for a further
piece of the same tensor in that file), so a rank's file is also a plain checkpoint of its
local shards. The index is built from the json and the safetensors headers alone, through
the storage, so a copy is read the same way from a directory and from a URL.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from ..expr import Source
from ..headers import DTYPES, TensorEntry
from ..index import CheckpointIndex
from .logical import Layout, Part, check_part_shapes
from .protocol import CheckpointSource, Format, OpenOptions, Storage

LAYOUT_JSON = "lazyload_sharded.json"
FORMAT = "lazyload-sharded"
VERSION = 1


def _fail(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; the layout json is corrupt (re-run save_sharded / lazyload reshard).")


def _int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _box(path: str, name: str, value: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    if not (isinstance(value, list) and len(value) == len(shape)
            and all(isinstance(span, list) and len(span) == 2 and all(_int(x) for x in span) for span in value)):
        raise _fail(path, f"tensor {name!r} has a piece box {value!r}, not one [start, stop] per dim of {list(shape)}")
    box = tuple((a, b) for a, b in value)
    if any(not a <= b <= n for (a, b), n in zip(box, shape)):
        raise _fail(path, f"tensor {name!r} has a piece box {value!r} outside its shape {list(shape)}")
    return box


def detect(storage: Storage, target) -> CheckpointSource | None:
    """A directory holding `lazyload_sharded.json`, or that json (or another name for it)."""
    if not isinstance(target, str):
        return None
    if storage.is_dir(target):
        path = storage.join(target, LAYOUT_JSON)
        if not storage.exists(path):
            return None
    elif target.endswith(".json") and not target.endswith(".index.json") and storage.exists(target):
        path = target
    else:
        return None
    doc = storage.read_json(path, "a checkpoint description json")
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT):
        return None
    doc = _document(path, doc)
    folder = storage.dirname(path)
    return CheckpointSource("sharded", [storage.join(folder, f["name"]) for f in doc["files"]], path)


def _document(path: str, doc: Any) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _fail(path, f"not a {FORMAT} description (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{path}: layout version {doc.get('version')!r}; this lazyload reads version "
                              f"{VERSION} (upgrade lazyload, or re-shard with this one).")
    files, tensors, world = doc.get("files"), doc.get("tensors"), doc.get("world")
    if not (_int(world) and world >= 1):
        raise _fail(path, f"world {world!r} is not a positive integer")
    if not (isinstance(files, list) and files and all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and _int(f.get("rank")) and f["rank"] < world
            for f in files)):
        raise _fail(path, "\"files\" must be a list of {\"name\": file, \"rank\": r < world}")
    if len({f["name"] for f in files}) != len(files):
        raise _fail(path, "a file is named twice in \"files\"")
    for f in files:
        norm = os.path.normpath(f["name"])
        if os.path.isabs(norm) or norm.startswith(os.pardir) or os.sep in norm or "\0" in norm:
            raise _fail(path, f"file name {f['name']!r} is not a plain file name inside the layout's directory")
    if not isinstance(tensors, dict):
        raise _fail(path, "\"tensors\" must be an object")
    return doc


def open_index(source: CheckpointSource, storage: Storage, options: OpenOptions = OpenOptions()) -> CheckpointIndex:
    layout_json = source.description
    doc = _document(layout_json, storage.read_json(layout_json, "a lazyload layout json"))
    files = source.files
    headers = storage.headers(files)
    stored = [{e.key: e for e in entries} for entries, _, _ in headers]
    header_bytes = sum(start for _, start, _ in headers)
    identities = {path: identity for path, (_, _, identity) in zip(files, headers)}
    entries: dict[str, TensorEntry] = {}  # piece key (unique over files) -> entry
    layouts = {}
    for name, info in doc["tensors"].items():
        if not (isinstance(info, dict) and isinstance(info.get("shape"), list) and all(_int(d) for d in info["shape"])
                and info.get("dtype") in DTYPES and isinstance(info.get("pieces"), list) and info["pieces"]):
            raise _fail(layout_json, f"tensor {name!r} needs a shape (list of sizes), a known dtype and a non-empty "
                                     "list of pieces")
        shape, dtype = tuple(info["shape"]), DTYPES[info["dtype"]]
        parts = []
        for piece in info["pieces"]:
            index, key = (piece.get("file"), piece.get("key")) if isinstance(piece, dict) else (None, None)
            if not (_int(index) and index < len(files) and isinstance(key, str)):
                raise _fail(layout_json, f"tensor {name!r} has a piece {piece!r} without a valid file index and key")
            entry = stored[index].get(key)
            if entry is None:
                raise CheckpointError(f"{layout_json}: tensor {name!r} has a piece {key!r} in {files[index]}, which "
                                      "that file does not hold; the layout json and its files disagree.")
            if entry.dtype != dtype:
                raise CheckpointError(f"{layout_json}: tensor {name!r} is {info['dtype']}, but its piece {key!r} in "
                                      f"{files[index]} is {entry.dtype}; the layout json and its files disagree.")
            box = _box(layout_json, name, piece.get("box"), shape)
            piece_key = f"{key}@{_basename(files[index])}"
            entries[piece_key] = entry
            parts.append(Part(Source(piece_key), box, doc["files"][index]["rank"]))
        check_part_shapes(name, parts, lambda k: entries[k].shape)
        layouts[name] = Layout(name, shape, dtype, tuple(parts), doc["world"])
    for index, by_key in enumerate(stored):
        for key in by_key:
            if f"{key}@{_basename(files[index])}" not in entries:
                raise CheckpointError(f"{files[index]} holds {key!r}, which {layout_json} does not place in any "
                                      "tensor; the layout json and its files disagree.")
    # Building the index tiles every tensor: pieces that do not tile it are refused here.
    return CheckpointIndex.of(files, entries.items(), layouts, header_bytes, layout_json, identities)


def _basename(path: str) -> str:
    return path.rpartition("/")[2].rpartition(os.sep)[2]


FORMAT_SHARDED = Format("sharded", detect, open_index, remote=True)
