"""MXFP4 weights in gpt-oss's layout (transformers' `integrations/mxfp4.py`): found by their
names, planned as `expr.Mxfp4` leaves, dequantized exactly as transformers does.

- `X_blocks` uint8 [..., R, K/32, 16]: E2M1 values two to a byte, element 2j in the low
  nibble and 2j+1 in the high one; bit 3 of a nibble is the sign, bits 0-2 index
  [0, 0.5, 1, 1.5, 2, 3, 4, 6].
- `X_scales` uint8 [..., R, K/32]: one E8M0 exponent per 32 values, 2^(s - 127); 255 is NaN.
- The dequantized [..., R, K] is what the module holds as [..., K, R] (gpt-oss's experts
  store [E, in, out]), so the leaf of `X` is the transpose of the last two dims.

Transformers computes `ldexp(lut[nibble], s - 127)` in the parameter's dtype; the same
ldexp in float32 cast once to the destination gives the same values (every E2M1 value has
at most two significant bits), which tests/test_mxfp4.py checks against its loader.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..errors import CheckpointError
from ..expr import Expr, Mxfp4, Transpose
from ..index import CheckpointIndex
from .finite import fits, refuse_non_finite
from .pieces import paired, stored_file

BLOCKS, SCALES = "_blocks", "_scales"
E8M0_NAN = 255
# E2M1 codes 0-15: bit 3 the sign, bits 0-2 the magnitude's index.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
CHUNK = 1 << 18  # float32 scratch elements per chunk (1 MiB: stays in a CPU cache)
_LUTS: dict[torch.device, torch.Tensor] = {}


def mxfp4_leaves(index: CheckpointIndex, tensors: dict) -> dict[str, tuple[Expr, str, str]]:
    """Logical weight name `X` -> (its leaf, its blocks name, its scales name) for every
    uint8 `X_blocks` with a uint8 `X_scales` sibling of shape blocks.shape[:-1] (with or
    without a quantization_config: gpt-oss's experts are never left unread)."""
    out = {}
    for name, (dtype, shape) in tensors.items():
        if dtype != torch.uint8 or not name.endswith(BLOCKS):
            continue
        base = name[:-len(BLOCKS)]
        scale = tensors.get(base + SCALES)
        if scale is None:
            continue
        if scale[0] != torch.uint8 or tuple(scale[1]) != tuple(shape[:-1]) or len(shape) < 3 or shape[-1] != 16:
            raise CheckpointError(f"{stored_file(index, name)}: {name!r} {list(shape)} and {base + SCALES!r} "
                                  f"{scale[0]} {list(scale[1])} are not MXFP4 blocks and scales (uint8 [..., K/32, 16] "
                                  "and uint8 [..., K/32]); lazyload cannot dequantize them.")
        try:
            leaf = paired(index.expr(name), index.expr(base + SCALES), Mxfp4, len(shape) - 1)
        except ValueError as exc:
            raise CheckpointError(f"{stored_file(index, name)}: the MXFP4 weight {base!r} cannot be paired with its "
                                  f"scales ({exc}); re-shard it from the original checkpoint.") from None
        ndim = len(shape) - 1
        out[base] = (Transpose(leaf, ndim - 2, ndim - 1), name, base + SCALES)
    return out


def dequantize_mxfp4_into(out: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the E2M1 `blocks` [..., G, 16] times 2^(`scales` [..., G] - 127) into `out`
    [..., G * 32] (any dtype and strides). An E8M0 NaN scale (255) is refused: transformers
    would load it as inf and NaN."""
    if bool((scales == E8M0_NAN).any()):
        at = (scales == E8M0_NAN).nonzero()[0].tolist()
        raise CheckpointError(f"an MXFP4 scale is {E8M0_NAN} (E8M0 NaN) at {at} of the scales read with this box "
                              "(the blocks' `_scales` tensor); the checkpoint is corrupt, a NaN scale makes every "
                              "one of its 32 weights NaN.")
    top = int(scales.max()) if scales.numel() else 0
    why = None if fits(math.ldexp(E2M1_MAX, top - 127), out.dtype) else f"MXFP4 scales up to {top} (2^{top - 127})"
    rows = max(1, CHUNK // (32 * blocks.shape[-2]))  # a chunk of rows through a float32 scratch
    for lead in itertools.product(*(range(n) for n in blocks.shape[:-3])):
        for r in range(0, blocks.shape[-3], rows):
            at = lead + (slice(r, r + rows),)
            _dequantize_rows(out[at], blocks[at], scales[at], why)


def _dequantize_rows(out: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, why: str | None) -> None:
    """`why`: the scales may give values out of range (then checked before they are placed)."""
    flat = _e2m1(blocks)  # [..., G, 32]
    torch.ldexp(flat, (scales.to(torch.int32) - 127).unsqueeze(-1), out=flat)
    if why is not None:
        refuse_non_finite(flat, (out.dtype,), why)
    out.copy_(flat.view(out.shape))  # the one rounding, to the destination dtype


# NVFP4: E2M1 nibbles two to a uint8 [..., R, K/2] (element 2j low), one float8_e4m3fn
# scale per 16 values [..., R, K/16], and one float32 scalar for the whole tensor.
NV_GROUP = 16
FP8_E4M3 = torch.float8_e4m3fn


def dequantize_nvfp4_into(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                          global_scale: torch.Tensor) -> None:
    """compressed-tensors' `nvfp4-pack-quantized` into `out` [..., R, K] (any dtype and strides):
    `e2m1 * (float32(scale) / global_scale)` in float32, rounded to bfloat16 (the dtype its
    decompressor unpacks to), then to `out`'s dtype, as its `NVFP4PackedCompressor.decompress`
    and transformers' `CompressedTensorsDequantize` compute it. A global scale that is zero,
    NaN or infinite is refused (it divides), as is a NaN scale."""
    divisor = _global(global_scale, "weight_global_scale", "it divides every scale")
    _dequantize_nvfp4(out, packed, scales, lambda s: s / divisor, torch.bfloat16,
                      f"NVFP4 scales (weight_scale / weight_global_scale {float(divisor):g})")


def dequantize_nvfp4_modelopt_into(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                                   scale_2: torch.Tensor) -> None:
    """ModelOpt's NVFP4 into `out` [..., R, K]: `e2m1 * (float32(scale) * weight_scale_2)` in
    float32, then one rounding to `out`'s dtype, as `NVFP4QTensor.dequantize` computes it."""
    factor = _global(scale_2, "weight_scale_2", "it multiplies every scale")
    _dequantize_nvfp4(out, packed, scales, lambda s: s * factor, None,
                      f"NVFP4 scales (weight_scale x weight_scale_2 {float(factor):g})")


def _global(value: torch.Tensor, name: str, why: str) -> torch.Tensor:
    """The float32 scalar of a one-entry global scale, refused when zero, NaN or infinite."""
    scalar = value.reshape(()).float()
    if not bool(torch.isfinite(scalar)) or float(scalar) == 0.0:
        raise CheckpointError(f"an NVFP4 {name} is {float(scalar)} (read with this box); {why}, so the weight "
                              "would be all zeros, inf or NaN. The checkpoint is corrupt or was never calibrated: "
                              "re-export it.")
    return scalar


def _dequantize_nvfp4(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale_of, via,
                      what: str) -> None:
    """E2M1 values times `scale_of(float32 scales)` per 16, in float32 chunks of rows, then
    rounded to `via` (if any) and to `out`'s dtype; `what`: that product, named in errors."""
    magnitudes = scales.view(torch.uint8) & 0x7F  # float8_e4m3fn's magnitude codes are in its values' order
    nan = magnitudes == 0x7F  # S.1111.111: float8_e4m3fn's NaN
    if bool(nan.any()):
        at = nan.nonzero()[0].tolist()
        raise CheckpointError(f"an NVFP4 weight_scale is NaN (float8_e4m3fn 0x7F) at {at} of the scales read with "
                              "this box; the checkpoint is corrupt, a NaN scale makes its 16 weights NaN.")
    top = scale_of(magnitudes.max().view(FP8_E4M3).float()) if magnitudes.numel() else torch.tensor(0.0)
    why = None if fits(E2M1_MAX * abs(float(top)), via, out.dtype) else f"{what} up to {float(top):g}"
    rows = max(1, CHUNK // max(1, 2 * packed.shape[-1]))
    lead = packed.shape[:-2]
    for at in itertools.product(*(range(n) for n in lead)):
        for r in range(0, packed.shape[-2], rows):
            box = at + (slice(r, r + rows),)
            values = _e2m1(packed[box])  # [rows, K] float32
            grouped = values.view(*values.shape[:-1], -1, NV_GROUP)
            grouped.mul_(scale_of(scales[box].float()).unsqueeze(-1))
            if why is not None:
                refuse_non_finite(values, (via, out.dtype), why)
            out[box].copy_(values.to(via) if via is not None and via != out.dtype else values)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2 * n] of E2M1 nibbles packed two to a byte [..., n], element 2j low."""
    lut = _LUTS.get(packed.device)
    if lut is None:
        lut = _LUTS.setdefault(packed.device, torch.tensor(E2M1, dtype=torch.float32, device=packed.device))
    values = torch.empty(*packed.shape, 2, dtype=torch.float32, device=packed.device)
    values[..., 0] = lut[(packed & 0x0F).long()]
    values[..., 1] = lut[(packed >> 4).long()]
    return values.view(*packed.shape[:-1], 2 * packed.shape[-1])
