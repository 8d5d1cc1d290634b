"""Megatron-LM per-rank checkpoints: `[iter_NNNNNNN|release]/mp_rank_XX/model_optim_rng.pt`,
one file per tensor-parallel rank, as logical tensors under transformers' names.

Each rank's file is a torch zip (`torch_files`): the model's tensors are indexed in place;
`args` (an `argparse.Namespace`, allowed) gives the heads and the MLP kind; optimizer and
RNG state are skipped (numpy arrays allowed so that the RNG state unpickles; nothing else).
Names follow transformers' Megatron conversions: GPT-2 (`transformer.h.N.attn.c_attn`, the
Conv1D layout: Megatron's [out, in] transposed) or, for SwiGLU models, Llama
(`model.layers.N.self_attn.q_proj`, ..., `mlp.gate_proj`/`up_proj` from each rank's
[gate; up]). Legacy (`language_model.encoder.layers.N.self_attention.query_key_value`) and
Megatron-core (`decoder.layers.N.self_attention.linear_qkv`) names are both read.

The fused QKV rows of one rank are laid out by checkpoint version (np: the rank's heads, hn:
head size, ng: its query groups, as DeepSpeed's `merge_query_key_value` documents):
0: [3, np, hn]; 1.0: [np, hn, 3] (q, k, v interleaved row by row); >= 2.0:
[ng, np/ng + 2, hn] (per group its q heads, then k, then v; ng = np without GQA). Each head
block is a chunk of its rank's piece, so a target rank reads only the heads it holds.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections import defaultdict
from typing import Any

from ..errors import CheckpointError, shown
from ..expr import Chunk, Expr, Source
from ..headers import TensorEntry
from ..index import CheckpointIndex
from . import torch_files
from .megatron_dist import TRACKER, Heads, args_heads, iteration_dir
from .logical import Layout, Part, check_part_shapes
from .protocol import CheckpointSource, Format, OpenOptions, Storage

_RANK_DIR = re.compile(r"^mp_rank_([0-9]{2})(_[0-9]{3})?$")
_LAYER = re.compile(r"^(?:encoder|transformer|decoder)\.layers\.([0-9]{1,9})\.(.+)\.(weight|bias|layer_norm_weight|"
                    r"layer_norm_bias|_extra_state)$")
# Megatron module (legacy and core names) -> role in a transformer layer.
_LAYER_ROLES = {
    "input_layernorm": "ln1", "self_attention.linear_qkv:ln": "ln1",
    "attention.query_key_value": "qkv", "self_attention.query_key_value": "qkv", "self_attention.linear_qkv": "qkv",
    "attention.dense": "proj", "self_attention.dense": "proj", "self_attention.linear_proj": "proj",
    "post_attention_layernorm": "ln2", "pre_mlp_layernorm": "ln2", "mlp.linear_fc1:ln": "ln2",
    "mlp.dense_h_to_4h": "fc1", "mlp.linear_fc1": "fc1",
    "mlp.dense_4h_to_h": "fc2", "mlp.linear_fc2": "fc2",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "embed", "embedding.position_embeddings.weight": "pos",
    "output_layer.weight": "out",
}
_FINAL = re.compile(r"^(?:encoder|transformer|decoder)\.final_(?:layer)?norm\.(weight|bias)$")
# role -> (GPT-2 name, Llama name, how ranks split it: dim, or None for replicated).
# Weights are Megatron's [out, in]; GPT-2's Conv1D names hold their transpose.
_NAMES = {
    "ln1": ("transformer.h.{i}.ln_1.{p}", "model.layers.{i}.input_layernorm.{p}", None),
    "ln2": ("transformer.h.{i}.ln_2.{p}", "model.layers.{i}.post_attention_layernorm.{p}", None),
    "proj.weight": ("transformer.h.{i}.attn.c_proj.weight", "model.layers.{i}.self_attn.o_proj.weight", 1),
    "proj.bias": ("transformer.h.{i}.attn.c_proj.bias", "model.layers.{i}.self_attn.o_proj.bias", None),
    "fc1.weight": ("transformer.h.{i}.mlp.c_fc.weight", None, 0),
    "fc1.bias": ("transformer.h.{i}.mlp.c_fc.bias", None, 0),
    "fc2.weight": ("transformer.h.{i}.mlp.c_proj.weight", "model.layers.{i}.mlp.down_proj.weight", 1),
    "fc2.bias": ("transformer.h.{i}.mlp.c_proj.bias", "model.layers.{i}.mlp.down_proj.bias", None),
    "embed": ("transformer.wte.weight", "model.embed_tokens.weight", 0),
    "pos": ("transformer.wpe.weight", None, None),
    "final": ("transformer.ln_f.{p}", "model.norm.{p}", None),
    "out": ("lm_head.weight", "lm_head.weight", 0),
}


def rank_files(path: str) -> list[str]:
    """The per-rank files of a Megatron checkpoint directory (its tracker's iteration, or
    the directory holding mp_rank_XX/), in rank order."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, "rb") as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
        path = os.path.join(path, iteration_dir(tag, tracker))
    ranks = sorted(n for n in (os.listdir(path) if os.path.isdir(path) else []) if _RANK_DIR.match(n))
    if any(_RANK_DIR.match(n).group(2) for n in ranks):
        raise CheckpointError(f"{path}: a pipeline-parallel Megatron checkpoint (mp_rank_XX_YYY); lazyload reads "
                              "tensor-parallel ones: merge the pipeline stages first (Megatron's checkpoint util).")
    files = []
    for name in ranks:
        found = [os.path.join(path, name, f) for f in ("model_optim_rng.pt", "model_rng.pt")
                 if os.path.isfile(os.path.join(path, name, f))]
        if not found:
            raise CheckpointError(f"{os.path.join(path, name)}: no model_optim_rng.pt in this rank's directory.")
        files.append(found[0])
    if not files:
        raise CheckpointError(f"{path}: no mp_rank_XX/model_optim_rng.pt here; point lazyload at a Megatron "
                              "checkpoint directory (the one holding latest_checkpointed_iteration.txt).")
    return files


def is_megatron_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER)) or any(_RANK_DIR.match(n) for n in os.listdir(path))


def _layout_version(value: Any, path: str) -> float:
    """The QKV layout version (checkpoint_version, or the DeepSpeed json's version) as a number."""
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except (ValueError, OverflowError):
        number = None
    if number is None or not 0 <= number < 100:
        raise CheckpointError(f"{path}: checkpoint_version is {shown(value)}, not a version number (0, 1.0, 2.0, "
                              "3.0: the layout of the fused QKV rows); the file is damaged: re-save it.")
    return number


def _heads(path: str, args: Any, version: float, tp: int) -> Heads:
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{path}: no Megatron args in the file; lazyload needs them (num_attention_heads, "
                              "hidden_size) to find each head in the fused QKV rows.")
    found = args_heads(args, path)
    saved_tp = getattr(args, "tensor_model_parallel_size", tp)
    if saved_tp != tp:
        raise CheckpointError(f"{path}: written for tensor-parallel size {shown(saved_tp)}, but {tp} rank file(s) "
                              "were found; pass every mp_rank_XX file.")
    if found.heads % tp or found.groups % tp:
        raise CheckpointError(f"{path}: {found.heads} heads in {found.groups} query groups do not split over {tp} "
                              "ranks.")
    if found.groups != found.heads and version < 2:
        raise CheckpointError(f"{path}: grouped-query attention in a version {version} checkpoint: no such layout.")
    return found


def _qkv_parts(version: float, heads: Heads, tp: int, pieces: list[tuple[Expr, TensorEntry]],
               entries: dict[str, TensorEntry]) -> dict[str, list[tuple[Any, int, int, int]]]:
    """Per component (q, k, v): (expr over a rank's piece, rank, first row in the component,
    rows), for the fused QKV weight or bias of one layer."""
    np_, ng, hn = heads.heads // tp, heads.groups // tp, heads.size
    out: dict[str, list] = {"q": [], "k": [], "v": []}
    for rank, (expr, entry) in enumerate(pieces):
        if not isinstance(expr, Source):
            raise CheckpointError(f"{entry.file}: the fused QKV {entry.key!r} is saved transposed; lazyload reads "
                                  "Megatron's own [rows, hidden] layout.")
        key = expr.key
        if version < 1:  # [3, np, hn]
            for s, comp in enumerate("qkv"):
                for j in range(np_):
                    out[comp].append((Chunk(Source(key), 0, s * np_ + j, 3 * np_), rank, (rank * np_ + j) * hn, hn))
        elif version < 2:  # [np, hn, 3]: a row of q, of k, of v, for each row of each head
            if len(entry.shape) == 2:  # as [np * hn, 3 * h]: q, k, v side by side
                rows, h = entry.shape[0] // 3, entry.shape[1]
                entries[key] = dataclasses.replace(entry, shape=(rows, 3 * h))
                for s, comp in enumerate("qkv"):
                    out[comp].append((Chunk(Source(key), 1, s, 3), rank, rank * rows, rows))
            else:
                rows = entry.shape[0] // 3
                for s, comp in enumerate("qkv"):
                    for r in range(rows):
                        out[comp].append((Chunk(Source(key), 0, 3 * r + s, 3 * rows), rank, rank * rows + r, 1))
        else:  # [ng, np/ng + 2, hn]
            per = np_ // ng
            for g in range(ng):
                for t in range(per + 2):
                    comp, head = ("q", rank * np_ + g * per + t) if t < per else ("kv"[t - per], rank * ng + g)
                    out[comp].append((Chunk(Source(key), 0, g * (per + 2) + t, ng * (per + 2)), rank, head * hn, hn))
    return out


def open_index(files: list[str], trust_pickle: bool = False, version: float | None = None) -> CheckpointIndex:
    """The logical tensors of a Megatron checkpoint whose rank files are `files` (rank order).
    `version`: the QKV layout version, when the files do not say (DeepSpeed's json)."""
    entries, by_name, header_bytes, args, saved_version = _rank_pieces(files, trust_pickle)
    version = _layout_version(version if version is not None else saved_version or 0, files[0])
    tp = len(files)
    heads = _heads(files[0], args, version, tp)
    llama = bool(getattr(args, "swiglu", False))
    layouts: dict[str, Layout] = {}

    def add(name: str, parts: list[Part], dtype, shape, transpose=False) -> None:
        check_part_shapes(name, parts, lambda k: entries[k].shape)
        layouts[name] = Layout(name, shape[::-1] if transpose else shape, dtype, tuple(parts), tp, transpose)

    for mname, pieces in by_name.items():
        if len(pieces) != tp:
            raise CheckpointError(f"{files[0]}: {mname!r} is in {len(pieces)} of the {tp} rank files; the "
                                  "checkpoint is incomplete.")
        shapes = {tuple(e.shape(lambda k: entries[k].shape)) for e, _ in pieces}
        if len(shapes) != 1:
            raise CheckpointError(f"{files[0]}: {mname!r} has different shapes across ranks {sorted(shapes)}.")
        local, dtype = shapes.pop(), pieces[0][1].dtype
        role, layer, param = _role(mname)
        if role is None:
            continue  # _extra_state and other non-weights
        if role == "qkv":
            _add_qkv(add, layer, param, pieces, entries, version, heads, tp, llama, dtype, local)
            continue
        if role == "fc1" and llama:
            rows = local[0] // 2
            for s, comp in enumerate(("gate", "up")):
                parts = [Part(Chunk(e, 0, s, 2), _rows(r * rows, rows, local), r) for r, (e, _) in
                         enumerate(pieces)]
                add(f"model.layers.{layer}.mlp.{comp}_proj.{param}", parts, dtype, (rows * tp,) + local[1:])
            continue
        key = role if role in ("embed", "pos", "out", "ln1", "ln2", "final") else f"{role}.{param}"
        gpt2, llama_name, dim = _NAMES[key]
        name = (llama_name if llama else gpt2) or mname
        name = name.format(i=layer, p=param)
        transpose = not llama and role in ("proj", "fc1", "fc2") and param == "weight"
        if dim is None:
            parts = [Part(e, tuple((0, n) for n in local), r) for r, (e, _) in enumerate(pieces)]
            add(name, parts, dtype, local)
        else:
            step = local[dim]
            parts = [Part(e, tuple((r * step, (r + 1) * step) if d == dim else (0, n)
                                   for d, n in enumerate(local)), r) for r, (e, _) in enumerate(pieces)]
            add(name, parts, dtype, tuple(n * tp if d == dim else n for d, n in enumerate(local)), transpose)
    return CheckpointIndex.of(files, entries.items(), layouts, header_bytes, os.path.dirname(files[0]))


Pieces = dict[str, list[tuple[Expr, TensorEntry]]]  # name -> its piece per rank


def _rank_pieces(files: list[str], trust_pickle: bool) -> tuple[dict[str, TensorEntry], Pieces, int, Any, Any]:
    """(stored entries, name -> its piece per rank, bytes that are not tensors, rank 0's
    args, rank 0's checkpoint_version) of the rank files, read in rank order."""
    allowed = [argparse.Namespace] + torch_files.numpy_arrays()
    entries: dict[str, TensorEntry] = {}
    by_name: Pieces = defaultdict(list)
    header_bytes, args, saved_version = 0, None, 0
    for rank, path in enumerate(files):
        tree = torch_files.load_tree(path, trust_pickle, allowed)
        if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
            raise CheckpointError(f"{path}: no 'model' state in it; this is not a Megatron checkpoint file.")
        if rank == 0:
            args, saved_version = tree.get("args"), tree.get("checkpoint_version", 0)
        size = os.path.getsize(path)
        header_bytes += size - torch_files.storage_bytes(tree)
        model = tree["model"].get("language_model", tree["model"])
        stored, parts = torch_files.locate(path, torch_files.tensors_of(model), size, f"mp_rank_{rank:02d}/")
        entries.update(stored)
        for key, part in parts.items():  # a piece saved transposed is the Transpose of its stored layout
            by_name[key.partition("/")[2]].append((part.expr, entries[part.expr.keys()[0]]))
    return entries, by_name, header_bytes, args, saved_version


def _rows(start: int, rows: int, local: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return ((start, start + rows),) + tuple((0, n) for n in local[1:])


def _role(name: str) -> tuple[str | None, int | None, str]:
    """(role, layer, param) of a Megatron model key; role None for what is not a weight."""
    if name in _GLOBAL:
        return _GLOBAL[name], None, "weight"
    final = _FINAL.match(name)
    if final:
        return "final", None, final.group(1)
    m = _LAYER.match(name)
    if m is None:
        raise CheckpointError(f"Megatron key {name!r} is not one lazyload knows how to name for transformers; "
                              "convert the checkpoint with Megatron's tools (or load it with key_map= after "
                              "converting it yourself).")
    layer, module, param = int(m.group(1)), m.group(2), m.group(3)
    if param == "_extra_state":
        return None, layer, param
    if param.startswith("layer_norm_"):
        module, param = module + ":ln", param.removeprefix("layer_norm_")
    role = _LAYER_ROLES.get(module)
    if role is None:
        raise CheckpointError(f"Megatron key {name!r}: module {module!r} is not one lazyload knows.")
    return role, layer, param


def _add_qkv(add, layer, param, pieces, entries, version, heads, tp, llama, dtype, local) -> None:
    parts = _qkv_parts(version, heads, tp, pieces, entries)
    rest = local[1:]
    if llama:
        for comp, n_heads in (("q", heads.heads), ("k", heads.groups), ("v", heads.groups)):
            name = f"model.layers.{layer}.self_attn.{comp}_proj.{param}"
            add(name, [Part(e, _rows(row, rows, local), r) for e, r, row, rows in parts[comp]], dtype,
                (n_heads * heads.size,) + rest)
        return
    offsets = {"q": 0, "k": heads.heads * heads.size, "v": (heads.heads + heads.groups) * heads.size}
    fused = [Part(e, _rows(offsets[c] + row, rows, local), r) for c in "qkv" for e, r, row, rows in parts[c]]
    total = (heads.heads + 2 * heads.groups) * heads.size
    add(f"transformer.h.{layer}.attn.c_attn.{param}", fused, dtype, (total,) + rest, param == "weight")


def detect(storage: Storage, target) -> CheckpointSource | None:
    """A Megatron checkpoint directory (its tracker, or mp_rank_XX/ directories)."""
    if isinstance(target, str) and os.path.isdir(target) and is_megatron_dir(target):
        return CheckpointSource("megatron", rank_files(target), target)
    return None


def _open(source: CheckpointSource, storage: Storage, options: OpenOptions) -> CheckpointIndex:
    return open_index(source.files, options.trust_pickle)


FORMAT_MEGATRON = Format("megatron", detect, _open, iterations=True)
