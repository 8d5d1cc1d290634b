"""torch.distributed.checkpoint (DCP) directories written by `FileSystemWriter`: `.metadata`
plus `__{rank}_{n}.distcp` files, each chunk of a tensor a stored entry, each tensor of
several chunks a logical tensor whose parts are its chunks' boxes.

`.metadata` (read by `dcp_metadata`, no pickled code run) gives every tensor's dtype, global
size and chunks (offsets, sizes), and where each chunk is stored: (file, offset, length).
There each chunk is a whole `torch.save` zip whose storage's raw bytes are found from the
zip's directory and local header (`torch_zip`), never by loading the chunk. Everything is
read through the storage (`protocol.Storage`), so a directory and its URL (`s3://`,
`https://`) index alike: the zip headers of all chunks through `Storage.ranges`, the
windows torch's layout puts them in (a URL's neighbours by one GET, concurrently).
Everything is checked before any tensor byte is read: chunks that do not cover their
tensor or overlap, a chunk with no storage entry, transformed (e.g. compressed) bytes, a zip
whose record is compressed or not aligned, a chunk whose pickled dtype or shape is not the
metadata's.
Non-tensor (bytes) items and training state (optimizer, schedulers, dataloader, RNG) are
not model weights and are left out; keys are the state dict's fqns (transformers' names
when an HF model's state dict was saved). A trainer's save, `dcp.save({"model":
model_state_dict, "optimizer": ...})` (torch's get_state_dict, FSDP2 trainers), keeps the
`model.` of its group on every fqn; the planner data says which fqns lie in that group, and
the index names them as the model's state dict does (`model_names`), so that every reader
of the checkpoint (load_into, vLLM's weight loaders) sees the model's own names.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import Any

from ..errors import CheckpointError
from ..expr import Source, Transpose, box_numel
from ..headers import TensorEntry
from ..index import CheckpointIndex
from . import torch_zip
from .dcp_metadata import MAX_METADATA, METADATA, Chunk, DcpMetadata, StorageInfo, TensorMeta, parse_metadata
from .logical import Layout, Part
from .protocol import CheckpointSource, Format, OpenOptions, Storage
from .ranges import FileRanges

# Top-level state-dict groups of training checkpoints that are not model weights.
TRAINING_STATE = ("optimizer", "optim", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler",
                  "dataloader", "train_state", "rng", "rng_state", "rng_tracker", "optimizer_state")
MODEL_GROUP = "model"  # a trainer's top-level group of the model's state dict


def metadata_path(storage: Storage, directory: str) -> str:
    return storage.join(directory, METADATA)


def is_dcp_dir(storage: Storage, path) -> bool:
    return isinstance(path, str) and storage.is_dir(path) and storage.exists(metadata_path(storage, path))


def read_dcp_metadata(storage: Storage, directory: str) -> tuple[DcpMetadata, int]:
    """The directory's `.metadata`, checked, and its size in bytes."""
    path = metadata_path(storage, directory)
    raw = storage.read(path, "a DCP .metadata", MAX_METADATA)
    return parse_metadata(raw, path), len(raw)


def detect(storage: Storage, target) -> CheckpointSource | None:
    """A DCP directory (its `.metadata`): its data files, the directory as description."""
    if not is_dcp_dir(storage, target):
        return None
    return CheckpointSource("dcp", data_files(storage, target, read_dcp_metadata(storage, target)[0]), target)


def data_files(storage: Storage, directory: str, metadata: DcpMetadata) -> list[str]:
    """The files the metadata's chunks lie in, each inside `directory` (locally checked to
    exist; a URL's first GET says so, naming the tensor that needed it)."""
    names = sorted({info.relative_path for info in metadata.storage.values()})
    out = []
    for name in names:
        path = storage.join(directory, name)
        if _outside(storage, directory, name, path):
            raise CheckpointError(f"{metadata_path(storage, directory)}: names the data file {name!r}, outside the "
                                  "checkpoint directory; refused.")
        if not storage.remote and not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; the DCP metadata stores chunks in it. Copy the whole "
                                  "checkpoint directory.")
        out.append(path)
    return out


def _outside(storage: Storage, directory: str, name: str, path: str) -> bool:
    if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/") or "://" in name:
        return True
    root = os.path.realpath(directory)
    return not storage.remote and os.path.commonpath([root, os.path.realpath(path)]) != root


def is_training_state(fqn: str) -> bool:
    return fqn.split(".", 1)[0] in TRAINING_STATE


def model_tensors(metadata: DcpMetadata) -> dict[str, TensorMeta]:
    return {fqn: meta for fqn, meta in metadata.tensors.items() if not is_training_state(fqn)}


def model_names(metadata: DcpMetadata) -> DcpMetadata:
    """The metadata with the trainer's `model.` group taken off its model tensors' fqns, when
    the planner data puts every one of them inside that group (`{"model": state_dict, ...}`);
    as saved otherwise, and where a name so made would be another entry's or training state."""
    model = model_tensors(metadata)
    if not model or not all(metadata.paths.get(fqn, ())[:1] == (MODEL_GROUP,) and len(metadata.paths[fqn]) > 1
                            for fqn in model):
        return metadata
    names = {fqn: fqn[len(MODEL_GROUP) + 1:] for fqn in model}
    others = (set(metadata.tensors) - set(model)) | set(metadata.byte_items)
    if any(is_training_state(name) or name in others for name in names.values()):
        return metadata
    return dataclasses.replace(
        metadata, tensors={names.get(fqn, fqn): meta for fqn, meta in metadata.tensors.items()},
        storage={(names.get(fqn, fqn), offsets): info for (fqn, offsets), info in metadata.storage.items()})


def check_chunks(where: str, fqn: str, meta: TensorMeta) -> list[Chunk]:
    """The tensor's non-empty chunks, once they are checked to tile it exactly."""
    chunks, seen = [], set()
    for chunk in meta.chunks:
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size)):
            raise CheckpointError(f"{where}: tensor {fqn!r}: chunk at {list(chunk.offsets)} of sizes "
                                  f"{list(chunk.sizes)} lies outside its size {list(meta.size)}; corrupt metadata.")
        if chunk.offsets in seen:
            raise CheckpointError(f"{where}: tensor {fqn!r}: two chunks at {list(chunk.offsets)}: overlapping "
                                  "chunks; the checkpoint is corrupt.")
        seen.add(chunk.offsets)
        if all(chunk.sizes):
            chunks.append(chunk)
    total = sum(box_numel(box_of(c)) for c in chunks)
    numel = box_numel(tuple((0, n) for n in meta.size))
    if total < numel:
        raise CheckpointError(f"{where}: tensor {fqn!r} of size {list(meta.size)}: its {len(chunks)} chunk(s) hold "
                              f"{total} of its {numel} elements: the chunks do not cover the tensor (a rank's "
                              "save missing?); the checkpoint is incomplete.")
    point = _first_miscovered(where, fqn, meta.size, chunks) if numel else None
    if point is not None:  # as many elements as the tensor, or more: some lie in two chunks
        pair = [c for c in chunks if all(o <= p < o + s for o, s, p in zip(c.offsets, c.sizes, point))][:2]
        at = (f" at {list(pair[0].offsets)} and {list(pair[1].offsets)}" if len(pair) == 2
              else f" (the element at {list(point)} is in none)")
        raise CheckpointError(f"{where}: tensor {fqn!r}: overlapping chunks{at}; the checkpoint is corrupt.")
    return chunks


def box_of(chunk: Chunk) -> tuple[tuple[int, int], ...]:
    return tuple((o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


MAX_CUT_DIMS = 6  # dims a tensor's chunks are cut along (a DTensor shards along its mesh's few dims)


def _first_miscovered(where: str, fqn: str, size: tuple[int, ...], chunks: list[Chunk]) -> tuple[int, ...] | None:
    """The first element (row-major) that is not in exactly one chunk; None when the chunks
    tile the tensor exactly. Linear in the chunks (no pair of them is compared):

    A box [a, b) is the product over its dims of (step up at a_k, step down at b_k), so the
    sum of the chunks' indicators, minus the tensor's, has as its mixed difference the signed
    corners (-1 per upper bound) of every chunk minus those of the tensor. They cancel
    exactly when every element is covered once; else the smallest corner left (a minimal
    one) is an element covered other than once. Dims no chunk is cut along are left out."""
    cut = [d for d, n in enumerate(size) if any(c.sizes[d] != n for c in chunks)]
    if len(cut) > MAX_CUT_DIMS:
        raise CheckpointError(f"{where}: tensor {fqn!r} of size {list(size)} is cut into chunks along {len(cut)} "
                              f"dims; lazyload reads tensors chunked along at most {MAX_CUT_DIMS}. The metadata is "
                              "corrupt, or the tensor was sharded in a way lazyload does not know.")
    corners: dict[tuple[int, ...], int] = {}
    whole = Chunk(tuple(0 for _ in size), size)
    for chunk, weight in [(whole, -1)] + [(c, 1) for c in chunks]:
        ends = [((chunk.offsets[d], 1), (chunk.offsets[d] + chunk.sizes[d], -1)) for d in cut]
        for corner in itertools.product(*ends):
            key = tuple(at for at, _ in corner)
            corners[key] = corners.get(key, 0) + weight * math.prod(sign for _, sign in corner)
    left = [key for key, count in corners.items() if count]
    if not left:
        return None
    point, first = [0] * len(size), min(left)
    for d, at in zip(cut, first):
        point[d] = at
    return tuple(point)


def _storage_of(where: str, metadata: DcpMetadata, fqn: str, chunk: Chunk) -> StorageInfo:
    info = metadata.storage.get((fqn, chunk.offsets))
    if info is None:
        raise CheckpointError(f"{where}: tensor {fqn!r}: no storage entry for its chunk at {list(chunk.offsets)}; "
                              "the checkpoint is incomplete.")
    if info.transforms:
        raise CheckpointError(f"{where}: tensor {fqn!r}: its chunk at {list(chunk.offsets)} is stored transformed "
                              f"({', '.join(info.transforms)}); lazyload reads raw torch.save chunks only. Save "
                              "without storage extensions (e.g. no compression).")
    return info


Planned = list[tuple[str, Chunk, StorageInfo]]  # (fqn, chunk, where its zip is) of every model chunk


def planned_chunks(where: str, metadata: DcpMetadata) -> Planned:
    """Every model tensor's non-empty chunks and their storage, every metadata check done
    (before any zip is opened); `where`: the `.metadata`, named in errors."""
    planned = [(fqn, chunk, _storage_of(where, metadata, fqn, chunk))
               for fqn, meta in model_tensors(metadata).items() for chunk in check_chunks(where, fqn, meta)]
    _check_disjoint(where, planned)
    return planned


def _check_disjoint(where: str, planned: Planned) -> None:
    """No two chunks' storage shares a byte: DCP saves each chunk as its own torch.save zip,
    so a shared one is corrupt or hostile (every chunk naming one zip would make indexing
    read its directory once per chunk, and tensors share bytes)."""
    spans = sorted((info.relative_path, info.offset, info.offset + info.length, i) for i, (_, _, info) in
                   enumerate(planned))
    for (path, _, end, i), (next_path, start, _, j) in zip(spans, spans[1:]):
        if path == next_path and start < end:
            raise CheckpointError(f"{where}: tensors {planned[i][0]!r} and {planned[j][0]!r}: their chunks at "
                                  f"{list(planned[i][1].offsets)} and {list(planned[j][1].offsets)} are stored in "
                                  f"overlapping bytes of {path!r}; each chunk is its own torch.save zip in a DCP "
                                  "checkpoint, so it is corrupt.")


def locate_chunks(storage: Storage, directory: str, metadata: DcpMetadata,
                  planned: Planned) -> tuple[list[torch_zip.StoredTensor], int, dict[str, Any]]:
    """Where each planned chunk's elements lie (from its zip's directory and pickle), the
    header bytes read, and the identity of each file as indexed. The zip headers are read
    through `storage.ranges`: for a URL every chunk's windows at once, neighbours by one GET."""
    paths = [storage.join(directory, info.relative_path) for _, _, info in planned]
    windows: dict[str, list] = {}
    for path, (_, _, info) in zip(paths, planned):
        windows.setdefault(path, []).extend(torch_zip.windows(info.offset, info.length))
    files = storage.ranges(windows)
    stored, identities = [], {}
    try:
        for path, (fqn, chunk, info) in zip(paths, planned):
            stored.append(_locate(files[path], fqn, chunk, metadata.tensors[fqn], info))
            identities[path] = files[path].identity
    finally:
        for file in files.values():
            file.close()
    return stored, sum(found.header_bytes for found in stored), identities


def _locate(src: FileRanges, fqn: str, chunk: Chunk, meta: TensorMeta, info: StorageInfo) -> torch_zip.StoredTensor:
    """One chunk's stored tensor; a failure names the tensor and chunk too."""
    try:
        if info.offset + info.length > src.identity.size:
            raise CheckpointError(f"{src.path}: the chunk at byte {info.offset} runs past the end of the file; it "
                                  "is truncated.")
        found = torch_zip.locate(src, info.offset, info.length)
    except CheckpointError as exc:  # remote ones too (RemoteError): the same kind, named by the tensor
        raise type(exc)(f"tensor {fqn!r}, chunk at {list(chunk.offsets)}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{src.path}: cannot read tensor {fqn!r}'s chunk ({exc.strerror or exc}).") from exc
    _check_stored(src.path, fqn, chunk, meta, found)
    return found


def _transposed(found: torch_zip.StoredTensor) -> bool:
    """A 2-D chunk saved as the transpose of a row-major tensor (DCP's clone keeps a
    transposed parameter's layout)."""
    shape = found.shape
    return len(shape) == 2 and found.stride == (1, shape[0]) and shape[0] > 1 and shape[1] > 1


def _check_stored(path: str, fqn: str, chunk: Chunk, meta: TensorMeta, found: torch_zip.StoredTensor) -> None:
    if found.dtype != meta.dtype or found.shape != chunk.sizes:
        raise CheckpointError(f"{path}: tensor {fqn!r}: the chunk at {list(chunk.offsets)} holds {found.dtype} "
                              f"{list(found.shape)}, but the metadata says {meta.dtype} {list(chunk.sizes)}; the "
                              "checkpoint's files and metadata disagree.")
    if not found.contiguous and not _transposed(found):
        raise CheckpointError(f"{path}: tensor {fqn!r}: the chunk at {list(chunk.offsets)} is saved strided "
                              f"(stride {list(found.stride)}); lazyload reads row-major (or transposed 2-D) chunks. "
                              "Save contiguous tensors.")


def chunk_keys(planned: list[tuple[str, Chunk]]) -> list[str]:
    """Each chunk's stored key: its fqn when it holds the whole tensor, else the fqn and
    its offsets (`model.layers.0.self_attn.q_proj.weight@16,0`)."""
    count: dict[str, int] = {}
    for fqn, _ in planned:
        count[fqn] = count.get(fqn, 0) + 1
    return [fqn if count[fqn] == 1 else f"{fqn}@{','.join(map(str, chunk.offsets))}" for fqn, chunk in planned]


def layouts_of(tensors: dict[str, TensorMeta], tiles: dict[str, list[Part]]) -> dict[str, Layout]:
    """fqn -> the Layout its chunks' parts tile (checked here: `expr` refuses gaps)."""
    layouts = {fqn: Layout(fqn, tensors[fqn].size, tensors[fqn].dtype, tuple(parts)) for fqn, parts in tiles.items()}
    for layout in layouts.values():
        layout.expr()
    return layouts


def entries_and_layouts(storage: Storage, metadata: DcpMetadata, planned: Planned,
                        stored: list[torch_zip.StoredTensor],
                        directory: str) -> tuple[dict[str, TensorEntry], dict[str, Layout]]:
    """A stored entry per chunk (its own row-major layout), and a Layout for every tensor
    of several chunks or saved transposed."""
    entries, tiles = {}, {}
    keys = chunk_keys([(fqn, chunk) for fqn, chunk, _ in planned])
    for (fqn, chunk, info), found, key in zip(planned, stored, keys):
        transposed = _transposed(found)
        key += "@T" if transposed else ""
        shape = found.shape[::-1] if transposed else found.shape
        entries[key] = TensorEntry(storage.join(directory, info.relative_path), key, found.dtype, shape,
                                   found.start, found.end)
        if key != fqn:
            tiles.setdefault(fqn, []).append(Part(Transpose(Source(key)) if transposed else Source(key), box_of(chunk)))
    return entries, layouts_of(metadata.tensors, tiles)


def index_of(storage: Storage, directory: str) -> CheckpointIndex:
    """The index of the DCP checkpoint in `directory`, from `.metadata` and the chunks' zip
    headers alone."""
    metadata, header = read_dcp_metadata(storage, directory)
    metadata = model_names(metadata)
    files = data_files(storage, directory, metadata)
    planned = planned_chunks(metadata_path(storage, directory), metadata)
    stored, zips, identities = locate_chunks(storage, directory, metadata, planned)
    entries, layouts = entries_and_layouts(storage, metadata, planned, stored, directory)
    return CheckpointIndex.of(files, entries.items(), layouts, header + zips, metadata_path(storage, directory),
                              identities)


def _open(source: CheckpointSource, storage: Storage, options: OpenOptions) -> CheckpointIndex:
    return index_of(storage, source.description)


FORMAT_DCP = Format("dcp", detect, _open, remote=True)
