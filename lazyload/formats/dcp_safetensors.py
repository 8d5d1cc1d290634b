"""DCP's safetensors flavour (`HuggingFaceStorageWriter(save_distributed=True)`): one
safetensors file per rank (`shard-{rank}-model-{n}-of-{N}.safetensors`, under `sharded/`
when a consolidated copy was written beside it) holding that rank's local chunks under the
state dict's (transformers') names, with each chunk's offsets in the global tensor in the
header's `DCP_SHARDING_INFO` (`{fqn: {"saved_offsets": [...]}}`).

No global shape is recorded: a tensor's size is the far corner of its chunks, which must
tile it exactly (`dcp.check_chunks`; the mapping then checks the size against the model).
Chunks of one name are stored keys `fqn@offsets` over each file's own key, and the tensor
is a logical tensor over them, as for DCP's own format. The consolidated copy
(`model-*-of-*.safetensors` and its index json) is plain safetensors.
"""
from __future__ import annotations

import json
import re

from ..errors import CheckpointError, shown
from ..expr import Source
from ..headers import MAX_INT64, entries_of_header, header_length, load_json
from ..index import INDEX_JSON, CheckpointIndex
from .dcp import box_of, check_chunks, chunk_keys, layouts_of
from .dcp_metadata import Chunk, TensorMeta
from .logical import Part
from .protocol import CheckpointSource, Format, OpenOptions, Storage
from .ranges import FileRanges

SHARD_FILE = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")
SHARDING_INFO = "DCP_SHARDING_INFO"
SHARDED_DIR = "sharded"
HEADER_WINDOW = 64 << 10  # read ahead for each file's header (a URL's first GET): a longer one costs a GET more


def shard_files(storage: Storage, path) -> list[str]:
    """The per-rank files of a directory that holds only them (no index json, no other
    safetensors); [] for any other directory, and where the storage cannot list (HTTP). The
    index json is probed first (as the safetensors format does: a URL's probe is kept), so
    that a folder holding one is never listed."""
    if not (isinstance(path, str) and storage.is_dir(path)) or storage.exists(storage.join(path, INDEX_JSON)):
        return []
    names = [n for n in storage.list(path) or [] if n.endswith(".safetensors")]
    if not names or not all(SHARD_FILE.match(n) for n in names):
        return []
    return sorted(storage.join(path, n) for n in names)


def detect(storage: Storage, target) -> CheckpointSource | None:
    """The directory of per-rank files (its files; the directory as description), else None."""
    files = shard_files(storage, target)
    return CheckpointSource("dcp_safetensors", files, target) if files else None


def _open(source: CheckpointSource, storage: Storage, options: OpenOptions) -> CheckpointIndex:
    return index_of(storage, source.files, source.description)


def _header(file: FileRanges) -> tuple[dict, int]:
    """(header dict, data start) of a safetensors file, read through its ranges."""
    length = header_length(file.path, file.read(0, 8, "the header length"), file.identity.size)
    header = load_json(file.path, file.read(8, length, "the header"), "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{file.path}: the header is no JSON object; the file is corrupt or not safetensors.")
    return header, 8 + length


def _offsets(path: str, header: dict) -> dict[str, tuple[int, ...]]:
    metadata = header.get("__metadata__")
    raw = metadata.get(SHARDING_INFO) if isinstance(metadata, dict) else None
    try:
        info = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        info = None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: no readable {SHARDING_INFO} in its header metadata; not a file of "
                              "torch's HuggingFaceStorageWriter(save_distributed=True).")
    out = {}
    for fqn, value in info.items():
        offsets = value.get("saved_offsets") if isinstance(value, dict) else None
        if not (isinstance(offsets, list) and all(type(o) is int and 0 <= o <= MAX_INT64  # noqa: E721 (no bools)
                                                  for o in offsets)):
            raise CheckpointError(f"{path}: {SHARDING_INFO} gives {shown(fqn)} no saved_offsets list (integers from 0 "
                                  f"to 2**63 - 1; found {shown(offsets)}); corrupt header.")
        out[fqn] = tuple(offsets)
    return out


def index_of(storage: Storage, files: list[str], directory: str) -> CheckpointIndex:
    """The logical tensors of the per-rank files `files`, from their headers alone."""
    chunks: dict[str, list] = {}
    header_bytes, identities = 0, {}
    ranges = storage.ranges({path: [(0, HEADER_WINDOW)] for path in files})
    try:
        headers = [(path, *_header(ranges[path]), ranges[path].identity) for path in files]
    finally:
        for file in ranges.values():
            file.close()
    for path, header, data_start, identities[path] in headers:
        header_bytes += data_start
        offsets = _offsets(path, header)
        for entry in entries_of_header(path, header, data_start, identities[path].size):
            where = offsets.get(entry.key)
            if where is None or len(where) != len(entry.shape):
                raise CheckpointError(f"{path}: tensor {entry.key!r} has no saved_offsets of its rank "
                                      f"({len(entry.shape)}) in {SHARDING_INFO}; corrupt header.")
            chunks.setdefault(entry.key, []).append((Chunk(where, entry.shape), entry))
    tensors = {fqn: _tensor(directory, fqn, pieces) for fqn, pieces in chunks.items()}
    planned = [(fqn, chunk, entry) for fqn, pieces in chunks.items() for chunk, entry in pieces]
    stored, tiles = [], {}
    for (fqn, chunk, entry), key in zip(planned, chunk_keys([(f, c) for f, c, _ in planned])):
        stored.append((key, entry))
        if key != fqn:
            tiles.setdefault(fqn, []).append(Part(Source(key), box_of(chunk)))
    return CheckpointIndex.of(files, stored, layouts_of(tensors, tiles), header_bytes, directory, identities)


FORMAT_DCP_SAFETENSORS = Format("dcp_safetensors", detect, _open, remote=True)


def _tensor(where: str, fqn: str, pieces: list) -> TensorMeta:
    """The global tensor its chunks span, once they are checked to tile it."""
    dtypes = {entry.dtype for _, entry in pieces}
    if len(dtypes) != 1:
        raise CheckpointError(f"{where}: tensor {fqn!r} is stored as {sorted(map(str, dtypes))} "
                              "in different rank files; the checkpoint is inconsistent.")
    ndim = len(pieces[0][0].sizes)
    if any(len(c.sizes) != ndim for c, _ in pieces):
        raise CheckpointError(f"{where}: tensor {fqn!r} has chunks of different ranks in different "
                              "rank files; the checkpoint is inconsistent.")
    size = tuple(max(c.offsets[d] + c.sizes[d] for c, _ in pieces) for d in range(ndim))
    meta = TensorMeta(dtypes.pop(), size, tuple(c for c, _ in pieces))
    check_chunks(where, fqn, meta)
    return meta
