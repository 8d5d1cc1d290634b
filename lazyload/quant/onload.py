"""Quantize on load: what to quantize (`Quantization`), and the stage between Reader and
Placer that turns a read full-precision slice into 8-bit data and float32 scales.

Scales cover groups of `group_size` elements of the input dim (the last one) per output
row: `scale = amax(|w|) / qmax` over each group, `q = w / scale` (rounded and clamped to
±127 for int8, cast to float8_e4m3fn for fp8, whose largest value is 448). Each group's
scale depends only on that group's bytes, so a tensor-parallel rank whose slice starts and
ends on group boundaries computes exactly the world=1 values of its slice. Vectorised over a
few rows at a time (a float32 scratch of about a megabyte), never a Python loop per group.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import ArgumentError, PlanError
from ..expr import Dequant, Expr, ShapeOf
from ..plan import Placement, ReadItem, local_regions
from .dequant import QuantizedBox

QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# Kept in full precision unless asked: the output head and MoE routers (embeddings and
# norms are no Linear layers, so never quantized).
DEFAULT_SKIP = (r"(^|\.)lm_head$", r"(^|\.)(gate|router)$")
CHUNK = 1 << 18  # float32 elements of scratch per step (1 MiB)


@dataclass(frozen=True)
class Quantization:
    """How `load_into(..., quantize=...)` quantizes a full-precision checkpoint on load.

    - `dtype`: "int8" (symmetric, ±127) or "fp8" (`torch.float8_e4m3fn`).
    - `group_size`: input-dim elements per scale, per output row (default 128; the last
      group of a row may be shorter). None: one scale per row of what the rank reads (under
      row-parallel TP a rank sees only part of a row, so its scales differ from world 1's).
    - `skip`: regexes (`re.search` on module names) of Linear layers kept in full
      precision, on top of the defaults (`lm_head`, MoE routers `gate` / `router`) and the
      model config's `modules_to_not_convert`.
    - `torchao`: True holds each quantized weight, where torchao 0.18 takes it (world 1, no
      short last group), as torchao's `Int8Tensor` / `Float8Tensor` in a plain `nn.Linear`
      (torchao must be installed: `pip install lazyload[torchao]`); the others stay
      `QuantizedLinear`. False (default): `QuantizedLinear` everywhere, no import of torchao."""

    dtype: str = "int8"
    group_size: int | None = 128
    skip: tuple[str, ...] = ()
    torchao: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in QDTYPES:
            raise ArgumentError(f"Quantization dtype={self.dtype!r}: use 'int8' or 'fp8'.")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ArgumentError(f"Quantization group_size={self.group_size!r}: a positive integer, or None for "
                                "one scale per row.")
        object.__setattr__(self, "skip", tuple(self.skip))
        if self.torchao:
            try:
                import torchao  # noqa: F401
            except ImportError as exc:
                raise ArgumentError("Quantization(torchao=True) needs torchao: pip install torchao (or "
                                    "lazyload[torchao]); or leave torchao=False for lazyload's QuantizedLinear.") from exc

    @property
    def torch_dtype(self) -> torch.dtype:
        return QDTYPES[self.dtype]

    @classmethod
    def of(cls, quantize: "str | Quantization | None") -> "Quantization | None":
        """The argument of `load_into(quantize=...)`: None, "int8", "fp8" or a Quantization."""
        if quantize is None or isinstance(quantize, Quantization):
            return quantize
        if isinstance(quantize, str) and quantize in QDTYPES:
            return cls(quantize)
        raise ArgumentError(f"quantize={quantize!r}: use None, 'int8', 'fp8' or lazyload.Quantization(...).")

    def skips(self, module_name: str, not_convert: tuple[str, ...] = ()) -> bool:
        if any(re.search(p, module_name) for p in DEFAULT_SKIP + self.skip):
            return True
        # transformers' modules_to_not_convert: a module name or a prefix of it.
        return any(module_name == n or module_name.startswith(n + ".") or module_name.endswith("." + n)
                   for n in not_convert)


class QuantizedDest(NamedTuple):
    """The destination of a quantized target: its 8-bit data and its scale grid
    (rows, ceil(columns / group)); `group` input elements per scale."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def scale_shape(shape: tuple[int, ...], group: int) -> tuple[int, ...]:
    return tuple(shape[:-1]) + (-(-shape[-1] // group),)


def quantize_into(dest: QuantizedDest, box: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
    """Quantize `values` (the full-precision `box` of the local tensor, on dest's device)
    into `dest`. The box's last dim starts on a group boundary and ends on one or at the
    end of the row (the plan checks it), so its groups are whole groups of the local tensor."""
    (c0, c1) = box[-1]
    g = dest.group
    qmax = QMAX[dest.data.dtype]
    data = dest.data[tuple(slice(a, b) for a, b in box)]
    scale = dest.scale[tuple(slice(a, b) for a, b in box[:-1]) + (slice(c0 // g, -(-c1 // g)),)]
    cols = c1 - c0
    groups = -(-cols // g)
    rows_of = values.reshape(-1, cols)
    data2, scale2 = data.reshape(-1, cols), scale.reshape(-1, groups)
    step = max(1, CHUNK // (groups * g))
    for r in range(0, rows_of.shape[0], step):
        w = rows_of[r:r + step]
        scratch = torch.zeros((w.shape[0], groups * g), dtype=torch.float32, device=w.device)
        scratch[:, :cols] = w
        blocks = scratch.view(w.shape[0], groups, g)
        amax = blocks.abs().amax(-1)
        s = amax / qmax
        s[s == 0] = 1.0  # an all-zero group: any scale gives zeros back
        blocks.div_(s.unsqueeze(-1))
        if dest.data.dtype == torch.int8:
            blocks.round_()
        blocks.clamp_(-qmax, qmax)
        data2[r:r + step] = scratch[:, :cols]
        scale2[r:r + step] = s
    if data2.data_ptr() != data.data_ptr() or not data.is_contiguous():  # reshape made copies: write back
        data.copy_(data2.view(data.shape))
        scale.copy_(scale2.view(scale.shape))


def group_size(config: Quantization, columns: int) -> int:
    return config.group_size if config.group_size is not None else max(1, columns)


def kept(weight_dtype: torch.dtype, qdtype: torch.dtype, has_zero: bool) -> bool:
    """A pre-quantized weight stays as stored when it already is what was asked for
    (symmetric, same 8-bit dtype); any other is dequantized and quantized again."""
    return weight_dtype == qdtype and not has_zero


def kept_group(expr: Dequant, shape: tuple[int, ...], placement: Placement, world: int) -> int:
    """The scale group of a weight kept as stored: its checkpoint's column block, narrowed
    (gcd) to the column offsets where ranks' slices start, so that each group of every
    rank's local tensor lies inside one checkpoint block and its re-gridded scale is exact."""
    group = expr.block[-1]
    for rank in range(world):
        for region in local_regions(expr.weight, shape, placement, rank, world)[1]:
            group = math.gcd(group, region.global_box[-1][0], region.local_start[-1])
    return group


def keep_into(dest: QuantizedDest, item: ReadItem, source: QuantizedBox) -> None:
    """A pre-quantized weight box as stored, and its scales re-gridded from the checkpoint's
    blocks to the destination's (row, group) grid: each local group lies in one block
    (`kept_group`), whose scale it takes."""
    data = dest.data[tuple(slice(a, b) for a, b in item.dst_box)]
    data.copy_(source.weight)
    (r0, r1), (c0, c1) = item.src_box
    (d0, _), (e0, e1) = item.dst_box
    block_r, block_c = item.scales.block
    g = dest.group
    rows = torch.arange(r0, r1, device=data.device) // block_r - r0 // block_r
    cols = torch.arange(c0, c1, g, device=data.device) // block_c - c0 // block_c
    scale = source.scale.float()
    if scale.numel() == 1:  # one scale for the whole weight
        scale, rows, cols = scale.reshape(1, 1), rows * 0, cols * 0
    else:
        scale = scale.reshape(item.scales.box[0][1] - item.scales.box[0][0], -1)
    dest.scale[d0:d0 + r1 - r0, e0 // g:-(-e1 // g)] = scale[rows][:, cols]


def check_groups(name: str, expr: Expr, shape: tuple[int, ...], placement: Placement, rank: int, world: int,
                 group: int, shape_of: ShapeOf) -> None:
    """Refuse, before any byte is read, a split that cuts a scale group of `name`: every
    group a rank quantizes must be a whole group of the world=1 weight, so that its scale
    comes from the same bytes."""
    cols = shape[-1]
    _, regions = local_regions(name, shape, placement, rank, world)
    for region in regions:
        a, b = region.global_box[-1]
        local = region.local_start[-1]
        ok = a % group == 0 and local % group == 0 and ((b - a) % group == 0 or b == cols)
        for piece in expr.pieces(region.global_box, shape_of) if ok else ():  # fused sources along columns
            c0, c1 = piece.dst_box[-1]
            ok = ok and c0 % group == 0 and (c1 % group == 0 or c1 == cols)
        if not ok:
            worlds = [w for w in range(1, 65) if cols % w == 0 and (cols // w) % group == 0]
            raise PlanError(f"{name}: this split of the input dim ({cols} columns, rank {rank} of {world}) cuts the "
                            f"quantization groups of {group} columns, so its scales would differ from world 1's. "
                            f"Use a world whose column shards are whole groups ({worlds or 'only world 1'}), a "
                            "smaller Quantization(group_size=...), or keep this layer in full precision "
                            f"(Quantization(skip=[...])).")
