"""INT4 weights of compressed-tensors' `pack-quantized` format (W4A16, Kimi-K2's routed
experts), dequantized exactly as its `PackedQuantizationCompressor.decompress` does.

- `X.weight_packed` int32 [..., R, K/8]: element 8j+i in bits 4i..4i+3 of word j, stored
  as q + 8 (q in [-8, 7]). On a little-endian host the words' bytes are then a stream of
  nibbles, element 2b in the low nibble of byte b and 2b+1 in the high one (as
  `unpack_from_int32` reads them).
- `X.weight_scale` [..., R, K/group] in the model's dtype (symmetric: no zero point).
- `X.weight_shape` int [2]: the unpacked shape.

compressed-tensors computes `q.to(scale.dtype) * scale` in the scale's dtype; the product
of a 4-bit integer and a bfloat16 or float16 scale is exact in float32, so float32 rounded
once to the scale's dtype gives the same values (for float32 scales, the same one rounding).
"""
from __future__ import annotations

import itertools
import sys

import torch

from ..errors import CheckpointError
from .finite import fits, refuse_non_finite

CHUNK = 1 << 18  # float32 scratch elements per chunk (1 MiB: stays in a CPU cache)
PER_WORD = 8  # 4-bit values per int32
CODE_MAX = 8  # |q| of q in [-8, 7]


def dequantize_int4_into(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Write `(q * scale)` rounded to the scales' dtype, then to `out`'s, into `out` [..., R, K]
    (any dtype and strides), from `packed` int32 [..., R, K/8] and `scales` [..., R, G]
    (K/G values per scale)."""
    if sys.byteorder != "little":  # the nibble stream below is the little-endian byte order
        raise CheckpointError("INT4 pack-quantized weights are read on little-endian hosts only.")
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        raise CheckpointError(f"an INT4 weight_scale is {float(scales[bad][0])} at {bad.nonzero()[0].tolist()} of the "
                              "scales read with this box; the checkpoint is corrupt, its group's weights would be "
                              "inf or NaN.")
    k = packed.shape[-1] * PER_WORD
    group = k // scales.shape[-1]
    top = float(scales.abs().max()) if scales.numel() else 0.0
    why = None if fits(CODE_MAX * top, scales.dtype, out.dtype) else f"INT4 weight_scale values (up to {top:g})"
    rows = max(1, CHUNK // max(1, k))
    for at in itertools.product(*(range(n) for n in packed.shape[:-2])):
        for r in range(0, packed.shape[-2], rows):
            box = at + (slice(r, r + rows),)
            nibbles = packed[box].contiguous().view(torch.uint8)  # [rows, K/2]
            values = torch.empty(*nibbles.shape, 2, dtype=torch.float32, device=packed.device)
            values[..., 0] = nibbles & 0x0F
            values[..., 1] = nibbles >> 4
            values.sub_(8)
            grouped = values.view(*nibbles.shape[:-1], -1, group)
            scale = scales[box]
            grouped.mul_(scale.float().unsqueeze(-1))
            flat = values.view(*nibbles.shape[:-1], k)
            if why is not None:
                refuse_non_finite(flat, (scale.dtype, out.dtype), why)
            out[box].copy_(flat.to(scale.dtype) if scale.dtype != out.dtype else flat)
