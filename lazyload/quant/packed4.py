"""4-bit weights packed along their input (last) dim with one scale per group of inputs,
found by their names (with or without a quantization_config) and planned as
`expr.Packed4` leaves, dequantized exactly as each format's own code does:

- compressed-tensors `nvfp4-pack-quantized`: `X.weight_packed` uint8 [..., R, K/2] (E2M1
  two to a byte, `quant.fp4`), `X.weight_scale` float8_e4m3fn [..., R, K/16] and
  `X.weight_global_scale` float32 [1], which divides every scale; the weight loads as
  `X.weight`. `X.input_global_scale` is the activations' (ignored, `formats.IGNORED`).
- compressed-tensors `pack-quantized` INT4 (W4A16, Kimi-K2's experts): `X.weight_packed`
  int32 [..., R, K/8] (`quant.int4`), `X.weight_scale` [..., R, K/group] and
  `X.weight_shape` (the unpacked shape); symmetric only (a packed zero point is refused).
- ModelOpt NVFP4 (`hf_quant_config.json`, quant_algo "NVFP4"): `X.weight` uint8
  [..., R, K/2], `X.weight_scale` float8_e4m3fn [..., R, K/16] and a 0-dim float32
  `X.weight_scale_2` that multiplies every scale. `X.input_scale` is the activations'.

The global scale is one entry read whole with every box (every rank reads its 4 bytes);
the packed data and the scales are cut together at group boundaries (`expr.Packed4`).
Only names, shapes and dtypes are read here (and, for a local INT4 checkpoint, the few
bytes of each `weight_shape`, which say what the packed data unpacks to).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..errors import CheckpointError, ReadError, ShapeMismatchError
from ..expr import Expr, Packed4, Source
from ..headers import TensorEntry
from ..index import CheckpointIndex
from ..readers.identity import RERUN, check_size, open_checked
from .pieces import paired, stored_file
from .qconfig import positive_int, weight_groups

PACKED, SCALE, GLOBAL, SHAPE, ZERO, SCALE_2 = "_packed", "_scale", "_global_scale", "_shape", "_zero_point", "_scale_2"
NVFP4, INT4, MODELOPT = "nvfp4", "int4", "nvfp4-modelopt"
NV_GROUP = 16
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Found:
    """One packed weight: its leaf, the stored name read as the packed data, the name it
    loads as, and the names of its scales (never keys of their own)."""

    leaf: Expr
    weight: str
    logical: str
    siblings: tuple[str, ...]
    codec: str


def packed4_leaves(index: CheckpointIndex, tensors: dict, config: dict | None) -> list[Found]:
    """Every 4-bit packed weight of the index (`tensors`: name -> (dtype, shape))."""
    groups = int4_group_sizes(config)
    found = []
    for name, (dtype, shape) in tensors.items():
        if name.endswith(PACKED) and name[:-len(PACKED)] + SCALE in tensors:
            found.append(_compressed(index, tensors, name, groups))
        elif dtype == torch.uint8 and name + SCALE_2 in tensors and name + SCALE in tensors:
            found.append(_modelopt(index, tensors, name))
    check_weight_shapes(index, [f for f in found if f.codec == INT4 and f.logical + SHAPE in f.siblings])
    return found


def _compressed(index: CheckpointIndex, tensors: dict, name: str, groups: set[int]) -> Found:
    """compressed-tensors' `X.weight_packed` (uint8: NVFP4; int32: INT4) with its siblings."""
    base = name[:-len(PACKED)]
    dtype, shape = tensors[name]
    scale = base + SCALE
    if base + ZERO in tensors:
        raise CheckpointError(f"{stored_file(index, name)}: {base + ZERO!r} is the zero point of an asymmetric 4-bit "
                              f"weight {name!r}; lazyload reads symmetric ones only. Dequantize the checkpoint first.")
    if dtype == torch.uint8:
        glob = base + GLOBAL
        if glob not in tensors:
            raise CheckpointError(f"{stored_file(index, name)}: the NVFP4 weight {name!r} has no {glob!r}; without its "
                                  "global scale its values are unknown. The checkpoint is incomplete.")
        _check_scales(index, name, scale, tensors, glob)
        leaf = _leaf(index, name, scale, glob, NVFP4, NV_GROUP, 2)
        return Found(leaf, name, base, (scale, glob), NVFP4)
    if dtype != torch.int32:
        raise CheckpointError(f"{stored_file(index, name)}: {name!r} is {dtype}; compressed-tensors packs 4-bit "
                              "weights into uint8 (nvfp4-pack-quantized) or int32 (pack-quantized), lazyload reads only "
                              "those.")
    k, cols = shape[-1] * 8, tensors[scale][1][-1] if tensors[scale][1] else 0
    group = k // cols if cols and k % cols == 0 else 0
    if not group or (groups and group not in groups):
        raise CheckpointError(f"{stored_file(index, name)}: {name!r} {list(shape)} (K = {k}) and {scale!r} "
                              f"{list(tensors[scale][1])} give no group size"
                              + (f" of those its config declares ({sorted(groups)})" if groups else "")
                              + "; lazyload cannot tell which scale covers which weights.")
    leaf = _leaf(index, name, scale, None, INT4, group, 8)
    return Found(leaf, name, base, (scale,) + ((base + SHAPE,) if base + SHAPE in tensors else ()), INT4)


def _modelopt(index: CheckpointIndex, tensors: dict, name: str) -> Found:
    """ModelOpt's NVFP4 `X.weight` uint8 with `X.weight_scale` and `X.weight_scale_2`."""
    scale, scale_2 = name + SCALE, name + SCALE_2
    _check_scales(index, name, scale, tensors, scale_2)
    return Found(_leaf(index, name, scale, scale_2, MODELOPT, NV_GROUP, 2), name, name, (scale, scale_2), MODELOPT)


def _check_scales(index: CheckpointIndex, name: str, scale: str, tensors: dict, glob: str) -> None:
    if tensors[scale][0] != FP8 or len(tensors[glob][1]) > 1 or math.prod(tensors[glob][1]) != 1:
        raise CheckpointError(f"{stored_file(index, name)}: {scale!r} is {tensors[scale][0]} and {glob!r} "
                              f"{list(tensors[glob][1])}; NVFP4 scales are float8_e4m3fn, one per 16 values, and its "
                              "global scale one float32. lazyload cannot dequantize this weight.")


def _leaf(index: CheckpointIndex, packed: str, scale: str, glob: str | None, codec: str, group: int,
          per: int) -> Expr:
    """The leaf of a packed weight stored whole or in pieces (a resharded copy: each packed
    piece with the scale piece cut alike); its shape checked against its scales'."""
    glob_expr = index.expr(glob) if glob is not None else None
    if glob_expr is not None and not isinstance(glob_expr, Source):
        raise CheckpointError(f"{stored_file(index, packed)}: the global scale {glob!r} of {packed!r} is stored in "
                              "pieces; it is one value. Re-shard the checkpoint from the original.")
    key = glob_expr.key if glob_expr is not None else None  # a copy's stored key in a resharded layout
    try:
        leaf = paired(index.expr(packed), index.expr(scale), lambda p, s: Packed4(p, s, key, codec, group, per))
        leaf.shape(index.shape_of)
    except ValueError as exc:
        raise CheckpointError(f"{stored_file(index, packed)}: {exc}; lazyload cannot dequantize {packed!r}.") from None
    return leaf


def check_weight_shapes(index: CheckpointIndex, found: list[Found]) -> None:
    """Each INT4 weight's `weight_shape` (a few bytes of a local file, read here before any
    weight byte) agrees with the shape its packed data and scales give: compressed-tensors
    unpacks to `weight_shape`, so a disagreement is a checkpoint lazyload would misread."""
    fds: dict[str, int] = {}
    try:
        for f in found:
            shape_key = index.expr(f.logical + SHAPE)
            entry = index[shape_key.key] if isinstance(shape_key, Source) else None
            if (entry is None or entry.file not in index.identities or "://" in entry.file
                    or entry.dtype.is_floating_point):
                continue  # in pieces, no file indexed (the writer's view of names), remote or not integers:
                # the packed shape and the model's decide
            raw = _read_entry(fds, index, entry)
            stored = tuple(int(v) for v in torch.frombuffer(bytearray(raw), dtype=entry.dtype).tolist())
            packed = f.leaf.shape(index.shape_of)
            if stored != tuple(packed):
                raise ShapeMismatchError(f"{entry.file}: {f.logical + SHAPE!r} says {f.logical!r} is {list(stored)}, "
                                         f"but {f.weight!r} and its scales hold {list(packed)}; the checkpoint is "
                                         "inconsistent (re-export it).", [(f.logical, stored, tuple(packed))])
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_entry(fds: dict[str, int], index: CheckpointIndex, entry: TensorEntry) -> bytes:
    """The bytes of `entry` from its file as it was indexed (the fd kept open in `fds`):
    a file gone, replaced, truncated or unreadable since is a ReadError naming it, as the
    readers raise for the same file."""
    identity = index.identities.get(entry.file)
    fd = fds.get(entry.file)
    if fd is None:
        fd = fds[entry.file] = open_checked(entry.file, identity)
    check_size(fd, entry.file, identity, entry.end)
    try:
        raw = os.pread(fd, entry.end - entry.start, entry.start)
    except OSError as exc:
        raise ReadError(f"{entry.file}: cannot read {entry.key!r} ({exc.strerror}); {RERUN}") from exc
    if len(raw) != entry.end - entry.start:
        raise ReadError(f"{entry.file}: {entry.key!r} read short ({len(raw)} of {entry.end - entry.start} bytes); "
                        f"{RERUN}")
    return raw


def int4_group_sizes(config: dict | None) -> set[int]:
    """The group sizes compressed-tensors' config declares for its `pack-quantized` groups."""
    if not config or config.get("quant_method") != "compressed-tensors":
        return set()
    out = set()
    for name, group, weights in weight_groups(config):
        if (group.get("format") or config.get("format")) == "pack-quantized" and weights.get("group_size"):
            out.add(positive_int(weights["group_size"], f"config_groups.{name}.weights.group_size"))
    return out
