"""DCP's `.metadata` (a pickle of `torch.distributed.checkpoint.metadata.Metadata`) read
without running pickled code: an unpickler that answers exactly the classes DCP writes
there with plain stand-ins, and refuses any other global with a CheckpointError naming it.
Before that, the pickle's object graph is bounded (`pickle_bounds`: a few bytes of shared
references would otherwise expand without end when hashed or printed).

What is kept: each tensor's dtype, global size and chunks (offsets, sizes), the fqns of
non-tensor (bytes) items, each chunk's storage (file relative to the checkpoint
directory, offset, length, transform descriptors), and the planner data's path of each fqn
in the saved state dict (("model", "lm_head.weight") for `{"model": state_dict}`; none when
the save did not flatten). The storage meta (paths, ids) is read into a stand-in and dropped.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field

import torch

from ..dtypes import TORCH_DTYPES
from ..errors import CheckpointError, shown
from ..headers import MAX_INT64
from .pickle_bounds import problem

METADATA = ".metadata"
_MODULE = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
# The classes DCP pickles into .metadata; each becomes a record of its pickled fields.
_RECORDS = {
    (_MODULE, "Metadata"), (_MODULE, "TensorStorageMetadata"), (_MODULE, "ChunkStorageMetadata"),
    (_MODULE, "BytesStorageMetadata"), (_MODULE, "MetadataIndex"), (_MODULE, "TensorProperties"),
    (_MODULE, "StorageMeta"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.distributed.checkpoint._hf_utils", "_HFStorageInfo"),
    # Megatron-Core keeps every rank's save plan beside the metadata (`all_local_plans`)
    (_PLANNER, "SavePlan"), (_PLANNER, "WriteItem"), (_PLANNER, "TensorWriteData"),
}
MAX_METADATA = 1 << 30  # far above a real checkpoint's metadata (megabytes)
_MAX_PATH = 4096  # a pickled path's parts, joined (PATH_MAX)


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass(frozen=True)
class DcpMetadata:
    tensors: dict[str, TensorMeta]
    byte_items: tuple[str, ...]
    storage: dict[tuple[str, tuple[int, ...]], StorageInfo]  # (fqn, chunk offsets) -> where its bytes are
    paths: dict[str, tuple] = field(default_factory=dict)  # fqn -> its keys in the saved (nested) state dict


class _Record:
    """A stand-in for one of DCP's metadata dataclasses: its pickled fields, nothing run."""

    kind = ""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) of a slotted dataclass
        self.fields = state if isinstance(state, dict) else {"state": state}

    def get(self, name, default=None):
        return getattr(self, "fields", {}).get(name, default)


def _record_class(name: str) -> type:
    return type(name, (_Record,), {"kind": name})


def _size(*args):
    return tuple(args[0]) if args else ()


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, path: str):
        super().__init__(io.BytesIO(raw))
        self.path = path
        self.classes = {key: _record_class(key[1]) for key in _RECORDS}

    def find_class(self, module: str, name: str):
        if (module, name) in self.classes:
            return self.classes[module, name]
        if (module, name) in ((_MODULE, "_MEM_FORMAT_ENCODING"), (_PLANNER, "WriteItemType")):
            return lambda value: value
        if (module, name) == ("torch", "Size"):
            return _size
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda layout: layout
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return self._path
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise CheckpointError(f"{self.path}: names the class {module}.{name}, which is not one of "
                              "torch.distributed.checkpoint's metadata classes; lazyload does not run pickled code. "
                              "The file is not a DCP .metadata, or a writer lazyload does not know put it there.")

    def _path(self, *parts) -> str:
        """A pickled pathlib path, joined: its parts are strings of a path's length."""
        if not all(isinstance(p, str) for p in parts) or sum(len(p) for p in parts) > _MAX_PATH:
            raise CheckpointError(f"{self.path}: holds a path whose parts are not {_MAX_PATH} characters of text; "
                                  "not a DCP .metadata.")
        return "/".join(parts)


def parse_metadata(raw: bytes, path: str) -> DcpMetadata:
    """The `.metadata` bytes read from `path` (a file or a URL), checked."""
    why = problem(raw)
    if why:
        raise CheckpointError(f"{path}: not a DCP .metadata lazyload can read: {why}. The checkpoint is corrupt "
                              "or was not written by torch.distributed.checkpoint.")
    try:
        root = _MetadataUnpickler(raw, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a malformed pickle: any of pickle's own errors
        raise CheckpointError(f"{path}: not a readable DCP .metadata ({type(exc).__name__}: {str(exc)[:200]}); "
                              "the checkpoint is corrupt or incomplete (was the save finished?).") from None
    if not (isinstance(root, _Record) and root.kind == "Metadata"):
        raise CheckpointError(f"{path}: holds no torch.distributed.checkpoint Metadata; not a DCP checkpoint.")
    return _convert(root, path)


def _bad(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; the DCP metadata is malformed or written by a version lazyload does "
                           "not know.")


def _ints(value, path: str, what: str) -> tuple[int, ...]:
    if not (isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT64
                                             for v in value)):
        raise _bad(path, f"{what} is {shown(value)}, not a tuple of sizes (integers from 0 to 2**63 - 1)")
    return value


def _convert(root: _Record, path: str) -> DcpMetadata:
    entries = root.get("state_dict_metadata")
    storage = root.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise _bad(path, "no state_dict_metadata / storage_data dicts")
    tensors, byte_items = {}, []
    for fqn, item in entries.items():
        if not isinstance(fqn, str) or not isinstance(item, _Record):
            raise _bad(path, f"entry {shown(fqn)} is not a named storage record")
        if item.kind == "BytesStorageMetadata":
            byte_items.append(fqn)
            continue
        if item.kind != "TensorStorageMetadata":
            raise _bad(path, f"entry {fqn!r} is a {item.kind}")
        tensors[fqn] = _tensor_meta(fqn, item, path)
    return DcpMetadata(tensors, tuple(byte_items), _storage(storage, path), _paths(root.get("planner_data")))


def _paths(planner_data) -> dict[str, tuple]:
    """fqn -> its path of keys, from DefaultSavePlanner's flattening (a writer that did not
    flatten leaves none; an entry that is not a path of keys is left out)."""
    if not isinstance(planner_data, dict):
        return {}
    return {fqn: keys for fqn, keys in planner_data.items() if isinstance(fqn, str) and isinstance(keys, tuple)
            and all(isinstance(k, (str, int)) for k in keys)}


def _tensor_meta(fqn: str, item: _Record, path: str) -> TensorMeta:
    props = item.get("properties")
    state = props.get("state") if isinstance(props, _Record) else None
    dtype = state[0] if isinstance(state, tuple) and state else props.get("dtype") if isinstance(props, _Record) else None
    if not isinstance(dtype, torch.dtype):
        raise _bad(path, f"tensor {fqn!r} has no dtype")
    size = _ints(item.get("size"), path, f"the size of {fqn!r}")
    chunks = item.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, _Record) for c in chunks):
        raise _bad(path, f"tensor {fqn!r} has no chunk list")
    out = []
    for c in chunks:
        offsets = _ints(c.get("offsets"), path, f"a chunk offset of {fqn!r}")
        sizes = _ints(c.get("sizes"), path, f"a chunk size of {fqn!r}")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _bad(path, f"a chunk of {fqn!r} has offsets {list(offsets)} / sizes {list(sizes)} for a "
                             f"{len(size)}-dim tensor")
        out.append(Chunk(offsets, sizes))
    return TensorMeta(dtype, size, tuple(out))


def _storage(storage: dict, path: str) -> dict[tuple[str, tuple[int, ...]], StorageInfo]:
    out = {}
    for index, info in storage.items():
        if not (isinstance(index, _Record) and isinstance(info, _Record) and isinstance(index.get("fqn"), str)):
            raise _bad(path, "a storage_data entry is not (MetadataIndex, storage info)")
        fqn, offset = index.get("fqn"), index.get("offset")
        offset = () if offset is None else _ints(offset, path, f"the storage offset of {fqn!r}")
        rel, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        transforms = info.get("transform_descriptors") or ()
        if not (isinstance(rel, str) and "\0" not in rel and _offset(start) and _offset(length)
                and isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)):
            raise _bad(path, f"the storage of {fqn!r} is not (relative_path, offset, length, transform names)")
        out[fqn, offset] = StorageInfo(rel, start, length, tuple(transforms))
    return out


def _offset(value) -> bool:
    """A byte offset or length a file can have."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT64
