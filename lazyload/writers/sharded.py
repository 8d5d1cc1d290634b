"""save_sharded: write a checkpoint pre-sharded for a tensor-parallel world, in lazyload's
layout (`formats/sharded.py`): one safetensors file per target rank (or per rank and layer
range), holding exactly the boxes that rank reads, plus `lazyload_sharded.json`.

The target layout is a plan: the model's placements at `world` (the same ones `load_into`
uses), pushed through the mapping down to boxes of the source's tensors (each source tensor
name is a leaf here, so the output keeps the source's names and global shapes). Each rank's
file is then written layer by layer: a layer's pieces are read through the Index (any
source format, split or whole) by the same engine and readers as a load, under the same
byte budget, and written out before the next layer is read.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from ..engine import run_schedule
from ..errors import ArgumentError, CheckpointError, PlanError
from ..expr import Box, Dequant, Source, box_numel, box_shape, full_box
from ..formats import CheckpointSource, open_index, resolve
from ..formats.logical import Layout, Part
from ..formats.sharded import FORMAT, LAYOUT_JSON, VERSION
from ..headers import DTYPES, TensorEntry
from ..index import CheckpointIndex
from ..mapping import Mapping, check_mapping, natural_key
from ..placer import TensorDest
from ..plan import Placement, check_rank, plan_for_rank
from ..planner import LoadOptions, byte_budget, map_checkpoint, plan_load
from ..quant.formats import read_quantization_config
from ..quant.onload import Quantization
from ..quant.targets import quantized_targets
from ..readers import PreadReader, Reader, RemoteReader
from ..remote import is_remote
from ..schedule import layer_of, schedule
from .compressed import encode, encoded_weights, entries, quantization_config
from .compressed4 import shared_global_scales
from .output import check_output, source_dirs, staged_directory
from ..stored import StoredCheckpoint, meta_model, transformers_config

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_CONFIGS = ("config.json", "generation_config.json")


def save_sharded(src: Any, out_dir: str | os.PathLike, world: int, plan: dict | str | None = None, *,
                 model: nn.Module | None = None, config: Any = None, max_file_bytes: int | None = None,
                 max_host_bytes: int | None = None, overwrite: bool = False,
                 quantize: str | Quantization | None = None) -> str:
    """Write `src` (any checkpoint lazyload reads, or a LazyCheckpoint) pre-sharded for `world`
    ranks into `out_dir`; returns the path of its `lazyload_sharded.json`.

    The split is the one `load_into(model, rank, world, plan=plan)` makes: `model` (best on
    meta) or one built on meta from `config` (a transformers config or a directory with
    config.json; default the source's directory). A rank's file is cut into several, by layer,
    when it would pass `max_file_bytes`. Host memory stays about one layer of one rank.

    `out_dir` must be new or empty, or `overwrite=True` replaces it; the source's own directory
    (or one inside it) is an OutputError, refused before anything is written. The files are
    written to a hidden directory beside `out_dir` that becomes `out_dir` only when complete.

    `quantize` ("int8", "fp8", "nvfp4", "int4:gN" or a `Quantization`; `world=1`) writes a compressed-tensors
    checkpoint instead (`model.safetensors`, or several files with their index, and
    `quantization_config` in config.json): the Linear weights as `load_into(model,
    quantize=...)` quantizes them, with their scales (see `writers/compressed.py`); returns the
    path of its config.json. Every rank of any world reads its own slice of it."""
    check_rank(0, world)
    qconfig = Quantization.of(quantize)
    if qconfig is not None and world != 1:
        raise ArgumentError(f"save_sharded(quantize={quantize!r}) writes a compressed-tensors checkpoint of whole "
                            f"tensors, from which each rank of any world reads its slice; pass world=1, not {world}.")
    if qconfig is not None and qconfig.dtype in ("mxfp4", "keep"):
        raise ArgumentError(f"save_sharded(quantize={quantize!r}): a compressed-tensors checkpoint is written with "
                            "'int8', 'fp8', 'nvfp4' or 'int4:gN' (4-bit as nvfp4-pack-quantized / pack-quantized).")
    if qconfig is not None and qconfig.format != "lazyload":
        raise ArgumentError(f"save_sharded(quantize=Quantization(format={qconfig.format!r})): that format is a holder "
                            "of a load (load_into); a checkpoint is written in compressed-tensors' groups: pass "
                            "quantize='int8', 'fp8' or Quantization(dtype, group_size=...).")
    src = StoredCheckpoint(src) if is_remote(src) else src  # read by ranged GETs, its config.json from the store
    index = _index_of(src)
    check_output(out_dir, source_dirs(_local_paths(src) + [f for f in index.files if not is_remote(f)]), overwrite)
    reader = _reader_of(src, index)
    view = _names_as_tensors(index)
    model = model if model is not None else _meta_model(config, src)
    if qconfig is not None:
        return _save_compressed(src, out_dir, index, view, model, qconfig, max_file_bytes, max_host_bytes, reader)
    boxes, quant = _rank_boxes(StoredCheckpoint.of_index(view, _quantization_config(src, index)), model, world, plan)
    for name in view:  # tensors no model tensor reads are kept, whole, in rank 0's file
        if name not in boxes:
            boxes[name][0].append(full_box(view[name].shape))
    pieces = _pieces(view, boxes, world, _scale_names(quant))
    with staged_directory(out_dir) as staging:
        _write_layout(staging, pieces, index, view, world, max_file_bytes, max_host_bytes, reader)
        _copy_configs(src, staging)
    return os.path.join(out_dir, LAYOUT_JSON)


def _rank_boxes(view: StoredCheckpoint, model: nn.Module, world: int, plan: dict | str | None) -> tuple[dict, Any]:
    """Source tensor name -> rank -> the boxes of it that rank reads, as `load_into` plans
    them (the same planner; each source name a leaf of the view): every single-tensor read
    of the plan's items, a pre-quantized weight's scale blocks and zero points included;
    and the view's pre-quantized weights."""
    options = LoadOptions(plan=plan, strict=False, missing="keep")
    boxes: dict[str, dict[int, list[Box]]] = defaultdict(lambda: defaultdict(list))
    mapped = map_checkpoint(view, view.index, model, None)
    if mapped.mapping.mismatched:
        check_mapping(Mapping(mapped.mapping.exprs, [], [], mapped.mapping.mismatched), view.index, mapped.specs)
    for rank in range(world):
        for item in plan_load(view, model, rank, world, options, preview=True, mapped=mapped).items:
            for read in item.reads():  # a dequantized item's scale blocks and zero points too
                if read.src_box not in boxes[read.entry.key][rank]:
                    boxes[read.entry.key][rank].append(read.src_box)
    return boxes, mapped.quant


def _write_layout(out_dir: str, pieces: dict, index: CheckpointIndex, view: CheckpointIndex, world: int,
                  max_file_bytes: int | None, max_host_bytes: int | None, reader: Callable[[], Reader]) -> None:
    """Every rank's files, then `lazyload_sharded.json` that describes them."""
    files, records = [], defaultdict(list)
    for rank in range(world):
        for part, chunk in enumerate(_cut(pieces[rank], view, max_file_bytes)):
            name = f"rank-{rank:05d}-of-{world:05d}" + (f"-{part:05d}" if part else "") + ".safetensors"
            _write_file(os.path.join(out_dir, name), chunk, index.for_rank(rank, world), view,
                        {"format": "pt", "lazyload_rank": str(rank), "lazyload_world": str(world)}, max_host_bytes,
                        reader=reader)
            for key, tensor, box in chunk:
                records[tensor].append({"file": len(files), "key": key, "box": [list(span) for span in box]})
            files.append({"name": name, "rank": rank})
    doc = {"format": FORMAT, "version": VERSION, "world": world, "files": files,
           "tensors": {name: {"shape": list(view[name].shape), "dtype": _DTYPE_NAMES[view[name].dtype],
                              "pieces": records[name]} for name in view}}
    with open(os.path.join(out_dir, LAYOUT_JSON), "w") as f:
        json.dump(doc, f, indent=1)


def _quantization_config(src: Any, index: CheckpointIndex) -> dict | None:
    """The source's `quantization_config` (its config.json's), so that its pre-quantized
    weights are paired with their scales as a load pairs them."""
    if hasattr(src, "quantization_config"):  # a LazyCheckpoint, local or remote
        return src.quantization_config()
    return read_quantization_config([f for f in index.files if "://" not in f])


def _scale_names(quant: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Pre-quantized weight name -> its block and the names of its scale (and zero point)
    tensors (each name of the view is a whole tensor: its leaf is one `Dequant`)."""
    return {name: (leaf.block, tuple(k for k in leaf.keys() if k != name))
            for name, leaf in quant.leaves.items() if isinstance(leaf, Dequant)}


def _local_paths(src: Any) -> list:
    """The path(s) the user named as the source, for the output check (a LazyCheckpoint's files come from its index)."""
    if isinstance(src, (str, os.PathLike)):
        return [src]
    return [p for p in src if isinstance(p, (str, os.PathLike))] if isinstance(src, (list, tuple)) else []


def _reader_of(src: Any, index: CheckpointIndex) -> Callable[[], Reader]:
    """What reads the source's bytes: ranged GETs for a URL's checkpoint, else pread."""
    remote = getattr(src, "remote", None)
    return (lambda: RemoteReader(remote, index.identities)) if remote is not None else PreadReader


def _copy_configs(src: Any, out_dir: str | os.PathLike) -> None:
    """The model's config files beside the rank files, so that the copy builds its model too
    (a URL's config.json, fetched from its store while indexing)."""
    if isinstance(src, StoredCheckpoint) and src.remote is not None and src.config_json() is not None:
        with open(os.path.join(out_dir, "config.json"), "wb") as f:
            f.write(src.config_json()[1])
    folder = src if isinstance(src, (str, os.PathLike)) and os.path.isdir(src) else None
    for name in _CONFIGS if folder is not None else ():
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))


def _index_of(src: Any) -> CheckpointIndex:
    if isinstance(src, CheckpointIndex):
        return src
    if isinstance(getattr(src, "index", None), CheckpointIndex):  # a LazyCheckpoint
        return src.index
    return open_index(src if isinstance(src, CheckpointSource) else resolve(src))


def _meta_model(config: Any, src: Any) -> nn.Module:
    """The model whose placements define the split, built on meta from its config."""
    if config is None and isinstance(src, StoredCheckpoint) and src.config_json() is not None:
        return meta_model(transformers_config(src))  # the config.json beside its files
    if config is None or isinstance(config, (str, os.PathLike)):
        where = config or (src if isinstance(src, (str, os.PathLike)) and os.path.isdir(src) else None)
        if where is None or not os.path.exists(os.path.join(where, "config.json") if os.path.isdir(where) else where):
            raise PlanError(f"{src}: no config.json to build the model whose split to write; pass model= (built "
                            "on meta) or config= (a transformers config or a directory holding config.json).")
        config = where
    return meta_model(transformers_config(None, config))


def _names_as_tensors(index: CheckpointIndex) -> CheckpointIndex:
    """The source's tensor names as whole tensors of their global shapes (a split tensor is
    one tensor here), so that the plan gives boxes of names rather than of stored pieces."""
    entries = []
    for name in index.names():
        dtype = index[index.expr(name).keys()[0]].dtype
        shape = index.shape(name)
        nbytes = box_numel(full_box(shape)) * dtype.itemsize
        entries.append((name, TensorEntry(index.files_of(name)[0], name, dtype, shape, 0, nbytes)))
    return CheckpointIndex.of(index.files, entries)


def _pieces(view: CheckpointIndex, boxes: dict, world: int,
            scales: dict[str, tuple[tuple[int, ...], tuple[str, ...]]]) -> dict[int, list[tuple[str, str, Box]]]:
    """Per rank, its (key in its file, tensor name, box), in layer order. A tensor whose
    boxes do not tile it (a part nobody reads, boxes that overlap) is stored whole instead,
    in each rank's file that reads any of it; so is a pre-quantized weight whose slices cut
    its blocks, with its scales (a load pairs each weight piece with its blocks' scale piece)."""
    by_name = {name: _tiling(name, boxes[name], view, world) for name in boxes}
    for weight, (block, siblings) in scales.items():
        if weight in by_name and any(a % b for bs in by_name[weight].values() for box in bs
                                     for (a, _), b in zip(box, block)):
            by_name[weight] = {rank: [full_box(view[weight].shape)] for rank in boxes[weight]}
            for sibling in siblings:
                by_name[sibling] = {rank: [full_box(view[sibling].shape)] for rank in boxes[weight]}
    per_rank: dict[int, list[tuple[str, str, Box]]] = defaultdict(list)
    for name in sorted(by_name, key=lambda n: (natural_key(layer_of(n)), natural_key(n))):
        for rank, bs in by_name[name].items():
            for i, box in enumerate(sorted(bs)):
                per_rank[rank].append((name if i == 0 else f"{name}@{i}", name, box))
    return per_rank


def _tiling(name: str, by_rank: dict[int, list[Box]], view: CheckpointIndex, world: int) -> dict[int, list[Box]]:
    """`by_rank` itself when its boxes tile the tensor, else the whole tensor for each of its ranks."""
    shape = view[name].shape
    parts = [Part(Source(name), box, rank) for rank, bs in by_rank.items() for box in bs]
    try:
        Layout(name, shape, view[name].dtype, tuple(parts), world).expr()
    except CheckpointError:
        return {rank: [full_box(shape)] for rank in by_rank}
    return by_rank


def _cut(pieces: list, view: CheckpointIndex, max_bytes: int | None) -> list[list]:
    """A rank's pieces in files of at most max_bytes, cut only between layers."""
    if max_bytes is None:
        return [pieces]
    chunks, size, last = [[]], 0, None
    for piece in pieces:
        nbytes = box_numel(piece[2]) * view[piece[1]].dtype.itemsize
        layer = layer_of(piece[1])
        if chunks[-1] and size + nbytes > max_bytes and layer != last:
            chunks.append([])
            size = 0
        chunks[-1].append(piece)
        size += nbytes
        last = layer
    return chunks


def _save_compressed(src: Any, out_dir: str | os.PathLike, index: CheckpointIndex, view: CheckpointIndex,
                     model: nn.Module, qconfig: Quantization, max_file_bytes: int | None,
                     max_host_bytes: int | None, reader: Callable[[], Reader]) -> str:
    """A compressed-tensors checkpoint of `src` in `out_dir`, layer by layer (world 1)."""
    stored = StoredCheckpoint.of_index(view, _quantization_config(src, index))
    mapped = map_checkpoint(stored, stored.index, model, None)
    exprs, specs = mapped.mapping.exprs, mapped.specs
    grids = quantized_targets(model, qconfig, exprs, specs, {}, stored.index, 0, 1)  # the load's own choice
    encoded = encoded_weights(grids, exprs, {name: view[name].shape for name in view}, qconfig)
    pieces = [(name, name, full_box(view[name].shape))
              for name in sorted(view, key=lambda n: (natural_key(layer_of(n)), natural_key(n)))]
    chunks = _cut(pieces, view, max_file_bytes)
    names = (["model.safetensors"] if len(chunks) == 1 else
             [f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors" for i in range(len(chunks))])
    weight_map, total = {}, 0
    with staged_directory(out_dir) as staging:
        for name, chunk in zip(names, chunks):
            total += _write_file(os.path.join(staging, name), chunk, index.for_rank(0, 1), view, {"format": "pt"},
                                 max_host_bytes, encoded, reader)
            weight_map.update({key: name for k, n, box in chunk
                               for key, _, _ in entries(k, view[n].dtype, box_shape(box), encoded.get(n))})
        if len(chunks) > 1:
            with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        _copy_configs(src, staging)
        _write_config(os.path.join(staging, "config.json"), model, quantization_config(model, encoded, qconfig), src)
    return os.path.join(out_dir, "config.json")


def _source_config(path: str, src: Any) -> dict:
    """The source's config.json (copied to `path`), refused unless a JSON object."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise CheckpointError(f"{src}: its config.json is not valid JSON ({type(exc).__name__}); fix it, or pass "
                              "config= (a directory holding a config.json).") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{src}: its config.json holds a {type(doc).__name__}, not an object; fix it, or pass "
                              "config= (a directory holding a config.json).")
    return doc


def _write_config(path: str, model: nn.Module, quantization: dict, src: Any) -> None:
    """config.json (the source's `src`, else the model's) with `quantization_config`."""
    if os.path.isfile(path):
        doc = _source_config(path, src)
    elif getattr(model, "config", None) is not None and hasattr(model.config, "to_dict"):
        doc = model.config.to_dict()
    else:
        raise PlanError(f"{path}: the source has no config.json and the model no config to write one from; pass "
                        "config= (a directory holding config.json) or a transformers model.")
    doc["quantization_config"] = quantization
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def _header(chunk: list, view: CheckpointIndex, metadata: dict, encoded: dict) -> tuple[bytes, int]:
    """A safetensors header for the chunk's pieces (each quantized one as its weight and
    scales), padded to 8 bytes, and the bytes of data it describes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, name, box in chunk:
        for out_key, dtype, shape in entries(key, view[name].dtype, box_shape(box), encoded.get(name)):
            nbytes = box_numel(full_box(shape)) * dtype.itemsize
            header[out_key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                               "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), offset


def _layer_reads(pieces: list, index: CheckpointIndex, view: CheckpointIndex) -> tuple[list, dict[str, TensorDest]]:
    """The schedule of one layer's pieces (key in the file, tensor name, box of it), planned
    by the planner's own `plan_for_rank` (each piece a target whose placement is its box),
    and a destination for each."""
    exprs = {key: index.expr(name) for key, name, _ in pieces}
    shapes = {key: view[name].shape for key, name, _ in pieces}
    dtypes = {key: view[name].dtype for key, name, _ in pieces}
    boxes = {key: Placement("box", spans=tuple((span,) for span in box)) for key, _, box in pieces}
    targets, items = plan_for_rank(exprs, index, shapes, dtypes, boxes)
    dests = {t.name: TensorDest(torch.empty(t.local_shape, dtype=t.dtype)) for t in targets}
    return schedule(items), dests


def _write_file(path: str, chunk: list, index: CheckpointIndex, view: CheckpointIndex, metadata: dict,
                max_host_bytes: int | None, encoded: dict | None = None,
                reader: Callable[[], Reader] = PreadReader) -> int:
    """One safetensors file: the header, then each layer's pieces as soon as they are read
    (those named in `encoded` quantized); returns the bytes of its tensors."""
    encoded = encoded or {}
    raw, total = _header(chunk, view, metadata, encoded)
    by_layer: dict[str, list] = defaultdict(list)
    for piece in chunk:
        by_layer[layer_of(piece[1])].append(piece)
    reader = reader()
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for layer_pieces in by_layer.values():
                groups, dests = _layer_reads(layer_pieces, index, view)
                run_schedule(groups, reader, dests, byte_budget(groups, max_host_bytes))
                shared = shared_global_scales({name: dests[key].tensor for key, name, _ in layer_pieces},
                                              {name: e.scheme for name, e in encoded.items()})
                for key, name, _ in layer_pieces:
                    for tensor in encode(dests[key].tensor, encoded.get(name), shared.get(name)):
                        f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    finally:
        reader.close()
    os.replace(path + ".tmp", path)
    return total
