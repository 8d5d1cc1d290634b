"""Dequantize a read box of a pre-quantized weight into its destination, exactly:
`out = ((q.float() - zero) * scale).to(out.dtype)`, each element with the scale of its
block, whatever box of the weight was read (boxes may start and end inside a block).

Vectorised: the box goes through a float32 scratch a few rows at a time (a cache-sized
chunk on CPU), laid out so that each block is a view ([blocks, block] per dim) and the
scales broadcast over it: one cast in, one multiply, one cast out per chunk, no loop
over blocks and no expanded copy of the scales.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .finite import fits, refuse_non_finite
from .fp4 import dequantize_mxfp4_into, dequantize_nvfp4_into, dequantize_nvfp4_modelopt_into
from .int4 import dequantize_int4_into

# Elements per chunk: the float32 scratch of a CPU chunk (1 MiB) stays in cache; on a GPU
# a chunk only bounds the scratch.
CPU_CHUNK = 1 << 18
GPU_CHUNK = 1 << 24


class QuantizedBox(NamedTuple):
    """What a reader returns for a dequantized item: the weight box, the scale entries
    covering it, their zero points (or None) and a 4-bit weight's global scale (or None)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    glob: torch.Tensor | None = None

    @classmethod
    def of(cls, scales, parts) -> "QuantizedBox":
        """The box of the tensors read for `ReadItem.reads()` (weight, scale, then the zero
        points and the global scale where `scales`, the item's `ScaleRead`, has them)."""
        weight, scale, *rest = parts
        zero = rest.pop(0) if scales.zero is not None else None
        return cls(weight, scale, zero, rest[0] if scales.glob is not None else None)

    def parts(self) -> list[torch.Tensor]:
        """The tensors in `ReadItem.reads()` order (the inverse of `of`)."""
        return [t for t in self if t is not None]

    def to(self, device, non_blocking: bool = False) -> "QuantizedBox":
        return QuantizedBox(*(t.to(device, non_blocking=non_blocking) if t is not None else None for t in self))


# How a 4-bit packed weight's box decodes (`ScaleRead.codec`; expr.Packed4, quant.packed4).
CODECS = {
    "nvfp4": lambda out, box: dequantize_nvfp4_into(out, box.weight, box.scale, box.glob),
    "nvfp4-modelopt": lambda out, box: dequantize_nvfp4_modelopt_into(out, box.weight, box.scale, box.glob),
    "int4": lambda out, box: dequantize_int4_into(out, box.weight, box.scale),
}


def dequantize_into(out: torch.Tensor, box: QuantizedBox, start: tuple[int, ...], block: tuple[int, ...],
                    codec: str | None = None) -> None:
    """Write the dequantized `box.weight` into `out` (same shape, any dtype and strides).
    `start`: where the box begins in the full weight; `block`: weight elements per scale
    entry along each dim. `box.scale` holds the entries of the blocks the box touches (or
    one entry for the whole weight). `codec`: a 4-bit packed weight's format (whole groups)."""
    q = box.weight
    if codec is not None:
        return CODECS[codec](out, box)
    if q.dtype == torch.uint8:  # packed E2M1 with E8M0 scales (expr.Mxfp4): whole groups
        return dequantize_mxfp4_into(out, q, box.scale)
    if q.ndim == 0:  # a scalar weight is a box of one element
        q, out, start, block = q.reshape(1), out.reshape(1), (0,), (1,)
    grid = _grid(start, q.shape, block)
    scale = box.scale.float().reshape(grid)
    zero = box.zero.float().reshape(grid) if box.zero is not None else None
    top = float(scale.abs().max()) if scale.numel() else 0.0  # NaN for a NaN scale: then every value is checked
    span = _code_max(q.dtype) + (float(zero.abs().max()) if zero is not None and zero.numel() else 0.0)
    why = None if fits(span * top, out.dtype) else f"scales up to {top:g} (times weights up to {span:g})"
    rows = q.shape[0]
    chunk = GPU_CHUNK if q.device.type == "cuda" else CPU_CHUNK
    step = max(1, chunk // max(1, math.prod(q.shape[1:])))
    for r in range(0, rows, step):
        stop = min(rows, r + step)
        at = (start[0] + r,) + tuple(start[1:])
        # The scale rows of this chunk's blocks (all of them when one scale spans the rows).
        lo = (start[0] + r) // block[0] - start[0] // block[0] if grid[0] > 1 else 0
        hi = (start[0] + stop - 1) // block[0] - start[0] // block[0] + 1 if grid[0] > 1 else 1
        _dequantize_chunk(out[r:stop], q[r:stop], scale[lo:hi], zero[lo:hi] if zero is not None else None,
                          at, block, why)


def dequantized(weight: torch.Tensor, scale: torch.Tensor, group: int, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """A new `dtype` tensor: the whole 8-bit `weight` with one float32 `scale` per group of
    `group` elements along `axis` (one per element along every other dim), dequantized."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    block = [1] * weight.ndim
    block[axis] = group
    dequantize_into(out, QuantizedBox(weight, scale), (0,) * weight.ndim, tuple(block))
    return out


def _code_max(dtype: torch.dtype) -> float:
    """The largest magnitude a stored 8-bit weight of `dtype` holds (448 for float8_e4m3fn)."""
    return float(torch.finfo(dtype).max if dtype.is_floating_point else -torch.iinfo(dtype).min)


def _grid(start, shape, block) -> tuple[int, ...]:
    """Scale entries touched per dim by the box `start`, `shape`."""
    return tuple((a + n - 1) // b - a // b + 1 for a, n, b in zip(start, shape, block))


def _to_float32(values: torch.Tensor, q: torch.Tensor) -> None:
    """values = q.float(), exactly (every int8 and float8 value is a float32). torch converts
    float8 one element at a time on CPU (~3 ns each); its bits rearranged into float16 and
    converted from there are ~10x faster, and give the same numbers, NaN included."""
    if q.device.type != "cpu" or q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        values.copy_(q)
        return
    bits = q.view(torch.int8).to(torch.int16)
    if q.dtype == torch.float8_e5m2:  # S.EEEEE.MM is the top byte of a float16
        bits <<= 8
        values.copy_(bits.view(torch.float16))
        return
    # S.EEEE.MMM -> float16 S.0EEEE.MMM0000000: the same number over 2**8 (exponent bias 15
    # instead of 7), subnormals included; the sign bit lands in place once bit 14 is cleared.
    bits <<= 7
    bits &= ~0x4000
    values.copy_(bits.view(torch.float16))
    values.mul_(256.0)
    codes = q.view(torch.int8) & 0x7F
    if int(codes.max()) == 0x7F:  # S.1111.111 is NaN, which float16 would read as 480
        values[codes == 0x7F] = float("nan")


def _dequantize_chunk(out, q, scale, zero, start, block, why: str | None) -> None:
    """One chunk: the box is placed in a float32 scratch padded to whole blocks along every
    dim it crosses blocks on, so that the scratch viewed as [blocks, block] per dim takes
    the scales ([blocks, 1] per dim) by broadcasting. `why`: the scales may give values out
    of `out`'s range (they are then checked before they are placed)."""
    padded, inner, blocks, scales = [], [], [], []
    for a, n, b, m in zip(start, q.shape, block, scale.shape):
        if m == 1:  # one scale along this dim: no padding, broadcast
            padded.append(n)
            inner.append(slice(0, n))
            blocks += [1, n]
        else:
            padded.append(m * b)
            inner.append(slice(a % b, a % b + n))
            blocks += [m, b]
        scales += [m, 1]
    scratch = torch.empty(padded, dtype=torch.float32, device=q.device)
    values = scratch[tuple(inner)]
    _to_float32(values, q)
    grouped = scratch.view(blocks)
    if zero is not None:
        grouped.sub_(zero.reshape(scales))
    grouped.mul_(scale.reshape(scales))
    if why is not None:
        refuse_non_finite(values, (out.dtype,), why)
    out.copy_(values)  # the one rounding, to the destination dtype
