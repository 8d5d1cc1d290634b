"""DeepSpeed's checkpoint description json, as `init_inference(checkpoint=...)` takes it:

    {"type": "ds_model" | "bloom" | "Megatron", "checkpoints": [...], "version": 1.0,
     "base_dir": ..., "parallelization": "pp" | "tp", "tp_size": N}

- "Megatron": the list is the per-rank Megatron files, in rank order (`megatron`; `version`
  is the QKV layout when the files do not record one).
- "ds_model" / "bloom" with a list: whole-tensor state dicts (`.bin`/`.pt` or safetensors).
- a dict {"tp": [...], "non_tp": [...]} (`parallelization: "tp"`, what DeepSpeed's
  `save_mp_checkpoint_path` writes): `tp_RR_MM.pt` hold rank RR's local shards of part MM,
  listed part by part (file i: rank i % tp_size); `non_tp` files hold whole tensors. Each
  sharded tensor is one logical tensor over its ranks' pieces. The files do not say which
  dim a tensor was cut on: pieces of different sizes say it; equal ones are cut as AutoTP
  cuts them, by module name (row-parallel `o_proj`, `down_proj`, `lm_head`, ...: the input
  dim of the weight, bias replicated; column-parallel `q_proj`, `gate_proj`, ...: the output
  dim; fused `qkv_proj`, `gate_up_proj`: each component on the output dim); anything else is
  a replicated copy. A wrong guess cannot load silently: the shapes then disagree with the
  model's.
File names are relative to `base_dir`, itself relative to the json's directory.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from ..errors import CheckpointError
from ..expr import Chunk, Source
from ..headers import TensorEntry, read_json
from ..index import CheckpointIndex
from ..names import COLWISE_NAMES, PACKED_NAMES, ROWWISE_NAMES
from . import megatron, torch_files
from .logical import Layout, Part
from .protocol import CheckpointSource, Format, OpenOptions, Storage

_ROW_PARALLEL = ROWWISE_NAMES | {"lm_head", "embed_out"}
DEEPSPEED_JSON = "ds_inference_config.json"  # what DeepSpeed's save_mp_checkpoint_path writes


def is_description(doc: Any) -> bool:
    return isinstance(doc, dict) and "checkpoints" in doc and "type" in doc


def _names(path: str, doc: dict, names: Any, what: str) -> list[str]:
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise CheckpointError(f"{path}: {what} must be a non-empty list of file names, got {names!r}.")
    base = doc.get("base_dir") or ""
    if not isinstance(base, str):
        raise CheckpointError(f"{path}: base_dir must be a string, got {base!r}.")
    folder = os.path.join(os.path.dirname(path), base)
    files = [os.path.join(folder, n) for n in names]
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"{path} lists {f}, which is missing (or not a regular file); check base_dir.")
    return files


def files_of(path: str) -> list[str]:
    doc = read_json(path, "a DeepSpeed checkpoint json")
    checkpoints = doc["checkpoints"]
    if isinstance(checkpoints, dict):
        return (_names(path, doc, checkpoints.get("tp"), "checkpoints.tp")
                + (_names(path, doc, checkpoints["non_tp"], "checkpoints.non_tp") if checkpoints.get("non_tp") else []))
    return _names(path, doc, checkpoints, "checkpoints")


def open_index(path: str, trust_pickle: bool = False) -> CheckpointIndex:
    doc = read_json(path, "a DeepSpeed checkpoint json")
    kind, checkpoints = str(doc.get("type", "")).lower(), doc.get("checkpoints")
    if kind == "megatron":
        return megatron.open_index(_names(path, doc, checkpoints, "checkpoints"), trust_pickle, doc.get("version"))
    if kind not in ("ds_model", "bloom"):
        raise CheckpointError(f"{path}: checkpoint type {doc.get('type')!r}; DeepSpeed's are 'ds_model', 'bloom' "
                              "and 'Megatron'.")
    if isinstance(checkpoints, list):
        files = _names(path, doc, checkpoints, "checkpoints")
        if all(torch_files.is_torch_file(f) for f in files):
            return torch_files.open_index(files, trust_pickle)
        if any(torch_files.is_torch_file(f) for f in files):
            raise CheckpointError(f"{path}: mixes torch and safetensors files; list one kind.")
        return CheckpointIndex(files)
    if not isinstance(checkpoints, dict):
        raise CheckpointError(f"{path}: checkpoints must be a list of files or {{'tp': [...], 'non_tp': [...]}}.")
    return _tp_index(path, doc, trust_pickle)


def _tp_index(path: str, doc: dict, trust_pickle: bool) -> CheckpointIndex:
    tp_files = _names(path, doc, doc["checkpoints"].get("tp"), "checkpoints.tp")
    non_tp = _names(path, doc, doc["checkpoints"]["non_tp"], "checkpoints.non_tp") if doc["checkpoints"].get(
        "non_tp") else []
    tp = doc.get("tp_size", doc.get("mp_size"))
    if not (type(tp) is int and tp > 0 and len(tp_files) % tp == 0):
        raise CheckpointError(f"{path}: tp_size {tp!r} does not divide the {len(tp_files)} tp files.")
    entries: dict[str, TensorEntry] = {}
    pieces: dict[str, dict[int, tuple[Any, TensorEntry]]] = defaultdict(dict)
    layouts: dict[str, Layout] = {}
    header_bytes = 0
    for i, f in enumerate(tp_files + non_tp):
        rank = i % tp if i < len(tp_files) else None
        tree = torch_files.load_tree(f, trust_pickle)
        if isinstance(tree, dict) and any(isinstance(v, (list, tuple)) for v in tree.values()):
            raise CheckpointError(f"{f}: holds [weight, scale] pairs (DeepSpeed's int8 kernel-injection layout); "
                                  "lazyload reads DeepSpeed's AutoTP (transformers-named) shards only.")
        size = os.path.getsize(f)
        header_bytes += size - torch_files.storage_bytes(tree)
        prefix = "" if rank is None else f"{os.path.basename(f)}/"
        stored, parts = torch_files.locate(f, torch_files.state_dict_of(tree), size, prefix, rank or 0)
        entries.update(stored)
        for key, part in parts.items():
            if rank is None:
                if not isinstance(part.expr, Source):
                    layouts[key] = Layout(key, tuple(b for _, b in part.box), entries[part.expr.keys()[0]].dtype,
                                          (part,))
                continue
            name = key.partition("/")[2]
            if rank in pieces[name]:
                raise CheckpointError(f"{f}: {name!r} is stored twice for rank {rank}.")
            pieces[name][rank] = (part.expr, entries[part.expr.keys()[0]])
    shape_of = lambda k: entries[k].shape  # noqa: E731
    for name, by_rank in pieces.items():
        if sorted(by_rank) != list(range(tp)):
            raise CheckpointError(f"{path}: {name!r} is in the tp files of ranks {sorted(by_rank)}, not all {tp}.")
        layouts[name] = _tp_layout(path, name, [by_rank[r] for r in range(tp)], shape_of)
    return CheckpointIndex.of(tp_files + non_tp, entries.items(), layouts, header_bytes, path)


def _tp_layout(path: str, name: str, pieces: list, shape_of) -> Layout:
    """One tensor from its per-rank shards (see the module docstring for the cut)."""
    shapes = [tuple(expr.shape(shape_of)) for expr, _ in pieces]
    dtype, first = pieces[0][1].dtype, shapes[0]
    module, _, param = name.rpartition(".")
    module = module.rpartition(".")[2]
    differ = [d for d in range(len(first)) if len({s[d] for s in shapes}) > 1]
    parts_n = PACKED_NAMES.get(module, 1) if len(first) else 1
    if len({len(s) for s in shapes}) > 1 or len(differ) > 1:
        raise CheckpointError(f"{path}: the shards of {name!r} have shapes {shapes}; they differ in more than one dim.")
    if differ:
        dim = differ[0]
    elif module in _ROW_PARALLEL:
        dim = len(first) - 1 if param == "weight" and len(first) == 2 else None
    elif module in COLWISE_NAMES or module in PACKED_NAMES:
        dim = 0
    else:
        dim = None
    if dim is None:  # a replicated tensor: a copy in each rank's file
        parts = tuple(Part(expr, tuple((0, n) for n in first), r) for r, (expr, _) in enumerate(pieces))
        return Layout(name, first, dtype, parts, len(pieces))
    parts, sizes = [], [s[dim] // parts_n for s in shapes]
    total = sum(sizes)
    for c in range(parts_n):  # a fused tensor: component c of every rank, then c + 1
        offset = c * total
        for r, (expr, _) in enumerate(pieces):
            box = tuple((offset, offset + sizes[r]) if d == dim else (0, n) for d, n in enumerate(shapes[r]))
            parts.append(Part(Chunk(expr, dim, c, parts_n) if parts_n > 1 else expr, box, r))
            offset += sizes[r]
    shape = tuple(total * parts_n if d == dim else n for d, n in enumerate(first))
    return Layout(name, shape, dtype, tuple(parts), len(pieces))


def detect(storage: Storage, target) -> CheckpointSource | None:
    """A directory holding `ds_inference_config.json`, or a DeepSpeed checkpoint json."""
    if not isinstance(target, str):
        return None
    path = os.path.join(target, DEEPSPEED_JSON) if os.path.isdir(target) else target
    if not (path.endswith(".json") and not path.endswith(".index.json") and os.path.isfile(path)):
        return None
    if not is_description(read_json(path, "a checkpoint description json")):
        return None
    return CheckpointSource("deepspeed", files_of(path), path)


def _open(source: CheckpointSource, storage: Storage, options: OpenOptions) -> CheckpointIndex:
    return open_index(source.description, options.trust_pickle)


FORMAT_DEEPSPEED = Format("deepspeed", detect, _open)
