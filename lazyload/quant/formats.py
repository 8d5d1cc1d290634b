"""Which checkpoint tensors are pre-quantized weights, and with which scales.

Detected from the tensors, with the checkpoint's `config.json` `quantization_config`
when there is one (the block size, the method):

- FP8 block-scaled (`quant_method: "fp8"`, DeepSeek-V3/R1, Qwen3 FP8): `X.weight` float8
  with `X.weight_scale_inv` float32, one entry per `weight_block_size` block (tail blocks
  partial), the multiplier that dequantizes it. Without a config the blocks are 128 wide,
  the published layout.
- compressed-tensors `int-quantized` / `float-quantized` / `naive-quantized` with 8-bit
  weights: `X.weight` int8 or float8 with `X.weight_scale` per tensor, channel, group or
  block, and `X.weight_zero_point` when present.

Every quantized weight becomes a `Dequant` expression over its weight, scale and zero-point
tensors, so that the siblings are never unexpected keys and a weight is never cast without
its scales. Scales of activations and of the KV cache (`input_scale`, `k_scale`, ...) mean
nothing to a full-precision model: they are ignored unless the model has such tensors.
Pairs are found by the index's tensor names, not its stored keys, so that detection
composes with every layout: a weight and its scale stored in pieces (lazyload's sharded
layout, Megatron, DeepSpeed) pair piece by piece, each weight piece with the scale piece
of its blocks (`_paired`, with zero points and per-tensor scales; the 4-bit formats found by
name pair theirs with `quant.pieces.paired`); pieces that cut a block are refused.
Only names, shapes, dtypes and config.json are read here; no tensor byte.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import torch

from ..errors import CheckpointError, shown
from ..expr import Cat, Dequant, Expr, Packed4, Source
from ..index import CheckpointIndex
from .fp4 import mxfp4_leaves
from .packed4 import packed4_leaves
from .qconfig import block_shape, positive_int, weight_groups
from .pieces import stored_file

WEIGHT_DTYPES = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # FP8 block layout; compressed-tensors
ZERO_SUFFIX = "_zero_point"
# Siblings of a quantized weight that change what its bytes mean and are not read here:
# activation reordering, packed 4-bit values, a second-level scale, block padding.
UNSUPPORTED_SUFFIXES = ("_g_idx", "_packed", "_shape", "_global_scale", "_shape_original")
# Scales of activations and of the KV cache: for quantized kernels, not for weights.
IGNORED = (r"\.(input|output)_(scale|zero_point)$", r"\.[qkv]_scale$", r"\.input_global_scale$")
METHODS = ("fp8", "compressed-tensors", "mxfp4", "modelopt")
COMPRESSED_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
# 4-bit formats whose weights are found by their names (quant.packed4): no blocks of 8-bit weights.
PACKED4_FORMATS = ("nvfp4-pack-quantized", "pack-quantized")
DEFAULT_BLOCK = 128  # DeepSeek-V3's and Qwen3 FP8's weight_block_size

logger = logging.getLogger("lazyload")


@dataclass(frozen=True)
class Quantization:
    """The quantized weights of a checkpoint: weight name -> its dequantization (a `Dequant`,
    or for a weight stored in pieces the tiling of one `Dequant` per piece); the scale and
    zero-point names those use; patterns of keys left unused unless the model has them."""

    leaves: dict[str, Expr] = field(default_factory=dict)
    siblings: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = ()
    weight_keys: frozenset[str] = frozenset()  # the stored keys of the quantized weights (of every piece)
    logical: dict[str, str] = field(default_factory=dict)  # a weight's name -> the name it loads as (X_blocks -> X)

    def values_dtype(self, key: str, stored: torch.dtype) -> torch.dtype | None:
        """The dtype of the values stored key `key` holds: None for a quantized weight (its
        8-bit storage is no dtype of values), else `stored`."""
        return None if key in self.weight_keys else stored


def read_quantization_config(files: Sequence[str]) -> dict | None:
    """`quantization_config` of the config.json beside the checkpoint's files, if any."""
    if not files:
        return None
    directory = os.path.dirname(os.path.abspath(files[0]))
    path = os.path.join(directory, "config.json")
    raw = _read_small(path)
    quant = quantization_config_of(path, raw) if raw is not None else None
    if quant is None:  # ModelOpt's own file (older exports write nothing into config.json)
        path = os.path.join(directory, "hf_quant_config.json")
        raw = _read_small(path)
        quant = modelopt_config_of(path, raw) if raw is not None else None
    return quant


def _read_small(path: str) -> bytes | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:  # the tensors alone still tell quantized weights
        logger.warning("%s: not read (%s); quantized weights are found from the tensors alone", path, exc)
        return None


def modelopt_config_of(where: str, raw: bytes) -> dict | None:
    """ModelOpt's `hf_quant_config.json` ({"quantization": {"quant_algo": ..., "group_size":
    ..., "exclude_modules": [...]}}) as a quantization_config (quant_method "modelopt")."""
    try:
        quant = json.loads(raw).get("quantization")
    except (ValueError, AttributeError, RecursionError) as exc:  # RecursionError: nested thousands deep
        logger.warning("%s: not read (%s); quantized weights are found from the tensors alone", where, exc)
        return None
    return {"quant_method": "modelopt", **quant} if isinstance(quant, dict) else None


def quantization_config_of(where: str, raw: bytes) -> dict | None:
    """`quantization_config` of a config.json's bytes (`where`: its path or URL), if any."""
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # the tensors alone still tell quantized weights
        logger.warning("%s: not read (%s); quantized weights are found from the tensors alone", where, exc)
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return quant if isinstance(quant, dict) else None


def detect(index: CheckpointIndex, config: dict | None = None,
           held: Callable[[str], bool] = lambda key: False) -> Quantization:
    """Pair every 8-bit weight with its scale (and zero point) siblings, by the index's
    tensor names (stored keys, or logical tensors stored in pieces). `held`: names the model
    itself holds as they are (a model with its own int8 weights and scales): such a pair is
    loaded as stored, not dequantized."""
    declared = config is not None
    blocks = _config_blocks(config) if declared else []
    leaves: dict[str, Expr] = {}
    siblings: set[str] = set()
    tensors = _tensors(index)  # name -> (dtype, shape)
    unsupported = any(k.endswith(UNSUPPORTED_SUFFIXES) for k in tensors)  # rare: then look per weight
    block_of: dict[tuple, tuple[int, ...]] = {}  # (weight shape, scale shape) -> block: one per layer kind
    held_pairs: set[str] = set()  # weights the model holds with their scales (transformers' FP8Linear)
    for name, (dtype, shape) in tensors.items():
        if dtype not in WEIGHT_DTYPES:  # most names: no sibling lookups
            continue
        scale = next((name + suffix for suffix in SCALE_SUFFIXES if name + suffix in tensors), None)
        if scale is None:
            continue
        if held(scale):
            held_pairs.add(name)
            continue
        for suffix in UNSUPPORTED_SUFFIXES if unsupported else ():
            if name + suffix in tensors:
                raise CheckpointError(f"{stored_file(index, name + suffix)}: {name + suffix!r} says that {name!r} is "
                                      "stored in a quantized layout lazyload cannot read yet (activation order, packed "
                                      "4-bit, global scale or padded blocks); dequantize the checkpoint first.")
        zero = name + ZERO_SUFFIX if name + ZERO_SUFFIX in tensors else None
        if not tensors[scale][0].is_floating_point:
            raise CheckpointError(f"{stored_file(index, scale)}: scale {scale!r} is {tensors[scale][0]}, not a "
                                  "floating point tensor; the checkpoint is not in a layout lazyload knows.")
        shapes = (shape, tensors[scale][1])
        block = block_of.get(shapes) or block_of.setdefault(shapes, _block(name, *shapes, blocks))
        leaves[name] = _paired(index, name, scale, zero, block)
        siblings.update((scale, zero) if zero else (scale,))
    logical = {}
    for found in packed4_leaves(index, tensors, config):  # 4-bit NVFP4 and INT4 (quant.packed4)
        if held(found.siblings[0]):  # a model holding the packed weight and its scales loads them as stored
            held_pairs.update((found.weight, *found.siblings))
            continue
        leaves[found.weight] = found.leaf
        siblings.update(found.siblings)
        if found.logical != found.weight:
            logical[found.weight] = found.logical
    if declared or leaves:
        _check_unscaled(tensors, index, leaves.keys() | held_pairs, siblings, config)
    weight_keys = {k for leaf in leaves.values() for k in _weight_pieces(leaf)}
    for base, (leaf, blocks, scales) in mxfp4_leaves(index, tensors).items():  # gpt-oss's experts (quant.fp4)
        leaves[blocks], logical[blocks] = leaf, base
        siblings.add(scales)
        weight_keys.add(blocks)
    return Quantization(leaves, frozenset(siblings), IGNORED if (declared or leaves) else (), frozenset(weight_keys),
                        logical)


def _weight_pieces(expr: Expr) -> list[str]:
    """The stored weight keys of a tiling of `Dequant`s (or of `Packed4`s)."""
    if isinstance(expr, Dequant):
        return [expr.weight]
    if isinstance(expr, Packed4):
        return [expr.packed]
    return [k for part in expr.parts for k in _weight_pieces(part)]


def _tensors(index: CheckpointIndex) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor name of the index (stored keys that are whole tensors, logical names)
    -> its dtype and shape."""
    entries = index.by_key()  # lookups without a method call each: 45k weights x 2-3 siblings
    out = {}
    for name in index.names():
        entry = entries.get(name)
        if entry is not None and index.name_of(name) == name:
            out[name] = (entry.dtype, entry.shape)
        else:
            out[name] = (entries[index.expr(name).keys()[0]].dtype, index.shape(name))
    return out


def _paired(index: CheckpointIndex, weight: str, scale: str, zero: str | None, block: tuple[int, ...]) -> Expr:
    """The dequantization of `weight`: one `Dequant` over stored keys, or for a weight
    stored in pieces the same tiling with each piece dequantized by the scale (and zero
    point) pieces of its blocks; a whole scale (one for the tensor) serves every piece."""
    exprs = (index.expr(weight), index.expr(scale), index.expr(zero) if zero else None)
    if all(isinstance(e, Source) for e in exprs if e is not None):
        return Dequant(exprs[0].key, exprs[1].key, block, exprs[2].key if zero else None)
    per_tensor = math.prod(index.shape(scale)) == 1
    try:
        return _pair_parts(*exprs, block, per_tensor, index.shape_of)
    except ValueError as exc:
        raise CheckpointError(f"{stored_file(index, weight)}: the quantized weight {weight!r} is stored in pieces that "
                              f"do not line up with the blocks of its scale {scale!r} ({exc}); each piece must "
                              f"hold whole blocks of {list(block)} (re-shard for a world whose slices do).") from None


def _pair_parts(weight: Expr, scale: Expr, zero: Expr | None, block: tuple[int, ...], per_tensor: bool,
                shape_of) -> Expr:
    """Walk the weight's tiling and the scale's side by side: a Cat of weight pieces pairs
    with a Cat of scale pieces along the same dim, piece for piece, each weight piece
    starting on a block boundary and its scale piece the grid of its blocks."""
    if isinstance(weight, Cat):
        if per_tensor:
            return Cat(tuple(_pair_parts(p, scale, zero, block, True, shape_of) for p in weight.parts), weight.dim)
        if not (isinstance(scale, Cat) and scale.dim == weight.dim and len(scale.parts) == len(weight.parts)
                and (zero is None or (isinstance(zero, Cat) and len(zero.parts) == len(weight.parts)))):
            raise ValueError("the scale is not cut where the weight is")
        for part in weight.parts[:-1]:
            if part.shape(shape_of)[weight.dim] % block[weight.dim]:
                raise ValueError(f"a piece of {part.shape(shape_of)[weight.dim]} along dim {weight.dim}")
        zeros = zero.parts if zero is not None else (None,) * len(weight.parts)
        return Cat(tuple(_pair_parts(w, s, z, block, False, shape_of)
                         for w, s, z in zip(weight.parts, scale.parts, zeros)), weight.dim)
    if not (isinstance(weight, Source) and isinstance(scale, Source) and (zero is None or isinstance(zero, Source))):
        raise ValueError(f"a piece {weight} that is no stored tensor of its own")
    leaf = Dequant(weight.key, scale.key, block if not per_tensor else tuple(shape_of(weight.key)),
                   zero.key if zero is not None else None)
    leaf.shape(shape_of)  # the scale piece is the grid of this piece's blocks
    return leaf


def _check_unscaled(tensors: dict, index: CheckpointIndex, leaves: Collection[str], siblings: set[str],
                    config: dict | None) -> None:
    """In a quantized checkpoint, an 8-bit weight without scales cannot be loaded: its
    bytes cast as they are would be a silently wrong model."""
    for name, (dtype, _) in tensors.items():
        if dtype not in WEIGHT_DTYPES or name in leaves or name in siblings:
            continue
        if not any(re.search(p, name) for p in IGNORED):
            method = (config or {}).get("quant_method", "scaled 8-bit weights")
            raise CheckpointError(f"{stored_file(index, name)}: {name!r} is {dtype} in a checkpoint quantized "
                                  f"with {shown(method)}, but has no scale ({name}_scale_inv or {name}_scale); a "
                                  "quantized weight is never loaded without its scales. The checkpoint is incomplete.")


def _config_blocks(config: dict) -> list[tuple[int | None, int | None]]:
    """The block shapes (rows, columns; None: the whole dim) the config declares for the
    last two dims of its weights. Refuses methods and formats lazyload cannot dequantize."""
    method = config.get("quant_method")
    if method == "fp8":
        size = config.get("weight_block_size")
        return [block_shape(size, "weight_block_size")] if size else [(None, None)]
    if method == "compressed-tensors":
        return _compressed_tensors_blocks(config)
    if method == "mxfp4":  # its blocks and scales are found by their names (quant.fp4)
        return []
    if method == "modelopt":  # NVFP4 weights are found by their names (quant.packed4)
        if config.get("quant_algo") != "NVFP4":
            raise CheckpointError(f"config.json: the checkpoint is quantized by ModelOpt with "
                                  f"{shown(config.get('quant_algo'))}; lazyload reads ModelOpt's NVFP4 only. "
                                  "Dequantize it with ModelOpt first.")
        return []
    raise CheckpointError(f"config.json: the checkpoint is quantized with {shown(method)}, which lazyload cannot "
                          f"dequantize (it reads {', '.join(METHODS)}); dequantize it with its own tools first.")


def _compressed_tensors_blocks(config: dict) -> list[tuple[int | None, int | None]]:
    top = config.get("format")
    blocks = []
    for name, group, weights in weight_groups(config):
        fmt = group.get("format") or top
        if fmt == "dense" or (fmt in PACKED4_FORMATS and weights.get("num_bits") == 4):
            continue  # 4-bit packed weights are found by their names (quant.packed4)
        if fmt not in COMPRESSED_FORMATS or weights.get("num_bits") != 8:
            raise CheckpointError(f"config.json: compressed-tensors group {name!r} stores weights as {shown(fmt)} with "
                                  f"{shown(weights.get('num_bits'))} bits; lazyload reads 8-bit weights in "
                                  f"{', '.join(COMPRESSED_FORMATS)}. Dequantize the checkpoint first.")
        strategy = weights.get("strategy")
        if strategy == "block":
            blocks.append(block_shape(weights.get("block_structure"), f"config_groups.{name}.weights.block_structure"))
        elif strategy == "group":
            blocks.append((1, positive_int(weights.get("group_size"), f"config_groups.{name}.weights.group_size")))
        elif strategy == "channel":
            blocks.append((1, None))
        elif strategy == "tensor":
            blocks.append((None, None))
        else:
            raise CheckpointError(f"config.json: compressed-tensors group {name!r} quantizes weights per "
                                  f"{shown(strategy)}, which lazyload cannot dequantize.")
    return blocks


def _block(key: str, shape: tuple[int, ...], scale: tuple[int, ...],
           declared: list[tuple[int | None, int | None]]) -> tuple[int, ...]:
    """Weight elements per scale entry, per dim: a declared block whose grid is the scale's
    shape, else per dim the only reading of the scale's size (every row, one for the dim,
    or 128-wide blocks)."""
    if math.prod(scale) == 1:
        return tuple(max(1, n) for n in shape)
    if len(scale) != len(shape):
        raise CheckpointError(f"scale of {key!r} has shape {list(scale)}, which does not match the weight's "
                              f"{list(shape)} dim for dim; lazyload cannot tell which block each scale covers.")
    for rows, cols in declared:
        last = shape[-2:]
        block = (1,) * (len(shape) - len(last)) + tuple(
            n if b is None else b for b, n in zip((rows, cols)[2 - len(last):], last))
        if _grid(shape, block) == tuple(scale):
            return block
    block = []
    for n, s in zip(shape, scale):
        if s == n:
            block.append(1)
        elif s == 1:
            block.append(n)
        elif s == -(-n // DEFAULT_BLOCK):
            block.append(DEFAULT_BLOCK)
        else:
            raise CheckpointError(f"scale of {key!r} has shape {list(scale)} for a weight of shape {list(shape)}; "
                                  "lazyload cannot tell the block size. Put the checkpoint's config.json (with "
                                  "its quantization_config) beside its files.")
    return tuple(block)


def _grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // b) for n, b in zip(shape, block))

