"""4-bit weights quantized on load, bit for bit as compressed-tensors quantizes them (its
`calculate_qparams` / `generate_gparam` on a min-max observer's per-group amax, then its
compressors' `compress`); the holder dequantizes with the checkpoint readers' own kernels
(`dequantize_packed`).

- **NVFP4** (`nvfp4-pack-quantized`): E2M1 values two to a byte (element 2j in the low
  nibble), a float8_e4m3fn scale per 16 input columns and a float32 global scale per tensor:
  `global = 448 * 6 / amax(W)`, `scale = fp8(global * amax_g / 6)`, `q = e2m1(w / (scale /
  global))`; W = e2m1 * (scale / global), in float32, rounded to bfloat16, then cast.
- **MXFP4** (compressed-tensors' MXFP4 preset, `mxfp4-pack-quantized`; the byte layout of
  gpt-oss's `_blocks` / `_scales`, which transformers quantizes only with triton kernels on a
  GPU, `downcast_to_mxfp`, not checked here): the same E2M1 bytes
  with an E8M0 exponent per 32 columns, `127 + floor(log2(pow2(amax_g))) - 2` (`pow2`:
  amax rounded to a power of two at E2M1's one mantissa bit), `q = e2m1(w / 2^(s - 127))`.
- **INT4** (`pack-quantized`, W4A16): `scale = amax_g / 7.5` in the weight's dtype,
  `q = round(clamp(w / scale, -8, 7))`, stored q + 8 in int32 words, element 8j+i in bits
  4i..4i+3; W = q * scale in the weight's dtype.

Every step runs in the dtype compressed-tensors runs it in (the weight's own for amaxes and
group scales; float32 where it mixes in a float32 global scale), so the bytes are its bytes.
"""
from __future__ import annotations

import torch

from .fp4 import dequantize_mxfp4_into, dequantize_nvfp4_into
from .int4 import dequantize_int4_into

FIXED_GROUP = {"nvfp4": 16, "mxfp4": 32}
PER_WORD = {"nvfp4": 2, "mxfp4": 2, "int4": 8}  # values per stored element (uint8; int32)
STORED = {"nvfp4": torch.uint8, "mxfp4": torch.uint8, "int4": torch.int32}
FP8_MAX, FP4_MAX = 448.0, 6.0
# E2M1 rounding as compressed-tensors' `cast_to_fp4` (ties to even): |x| above or at each
# threshold moves up one code.
_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_MANTISSA = {torch.bfloat16: (7, 8, torch.int16), torch.float16: (10, 5, torch.int16),
             torch.float32: (23, 8, torch.int32)}


def stored_shape(shape: tuple[int, ...], scheme: str) -> tuple[int, ...]:
    """The shape of the packed tensor holding a weight of `shape` (packed along the last dim)."""
    return tuple(shape[:-1]) + (shape[-1] // PER_WORD[scheme],)


def scale_dtype(scheme: str, weight_dtype: torch.dtype) -> torch.dtype:
    return {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}.get(scheme, weight_dtype)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 [1]: 448 * 6 / amax of the whole tensor (`amax` in the weight's dtype), 1 where
    that is not finite (compressed-tensors' `generate_gparam`)."""
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    scale = FP8_MAX * FP4_MAX / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def quantize_rows(scheme: str, w: torch.Tensor, group: int, global_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) of the 2-D `w` (whole groups per row, in the weight's dtype)."""
    groups = w.unflatten(-1, (w.shape[-1] // group, group))
    amax = groups.abs().amax(-1)
    # Constants as tensors on the device, as compressed-tensors has them: CUDA would divide by
    # a CPU scalar as `a * (1 / b)`, which may differ in the last bit.
    const = lambda value, dtype=w.dtype: torch.tensor(value, dtype=dtype, device=w.device)  # noqa: E731
    if scheme == "int4":
        scale = amax / const(7.5)
        scale = torch.where(scale == 0, const(torch.finfo(w.dtype).eps), scale)
        q = torch.round(torch.clamp(groups / scale.unsqueeze(-1), const(-8.0, torch.float32), const(7.0, torch.float32)))
        return pack_int4(q.to(torch.int8).flatten(-2)), scale
    if scheme == "nvfp4":
        scale = global_scale * (amax / const(FP4_MAX))
        scale = torch.clamp(scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        scale = torch.where(scale == 0, const(0.125, torch.float32), scale)
        values = groups / (scale / global_scale).unsqueeze(-1)
        return pack_e2m1(e2m1_codes(values.flatten(-2))), scale.to(torch.float8_e4m3fn)
    exponent = mx_exponents(amax)
    values = groups / (2.0 ** (exponent.to(torch.float32) - 127)).to(w.dtype).unsqueeze(-1)
    return pack_e2m1(e2m1_codes(values.flatten(-2))), exponent


def mx_exponents(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 (uint8) of each group: `amax` (the weight's dtype) rounded to a power of two
    (up from 1.5 times one, E2M1 keeping one mantissa bit), over E2M1's largest power 2^2."""
    mantissa, exponent_bits, int_dtype = _MANTISSA[amax.dtype]
    bits = amax.view(int_dtype).to(torch.int32)
    mask = ((1 << (exponent_bits + 1)) - 1) << mantissa
    rounded = ((bits + (1 << (mantissa - 2))) & mask)
    power = rounded.to(int_dtype).view(amax.dtype) if int_dtype is torch.int16 else rounded.view(amax.dtype)
    exponent = 127 + torch.floor(torch.log2(power)) - 2
    return torch.round(torch.clamp(exponent, 0, 255)).to(torch.uint8)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 code (sign in bit 3) nearest each value, as compressed-tensors rounds."""
    mag = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in _UP:
        codes += (mag >= threshold) if inclusive else (mag > threshold)
    codes |= (x < 0).to(torch.uint8) << 3
    return codes


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] -> int32 words of 8 (q + 8 in bits 4i..4i+3 of word j for element 8j+i)."""
    nibbles = (q.to(torch.int32) + 8).unflatten(-1, (q.shape[-1] // 8, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (nibbles << shifts).sum(-1, dtype=torch.int32)


def dequantize_packed(scheme: str, packed: torch.Tensor, scale: torch.Tensor, group: int,
                      global_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The `dtype` weight the packed bytes and scales hold, with the dequantizers of the
    checkpoints' readers (compressed-tensors' decompression; MXFP4 as transformers')."""
    out = torch.empty(packed.shape[:-1] + (packed.shape[-1] * PER_WORD[scheme],), dtype=dtype, device=packed.device)
    if scheme == "int4":
        dequantize_int4_into(out, packed, scale)
    elif scheme == "nvfp4":
        dequantize_nvfp4_into(out, packed, scale, global_scale)
    else:
        dequantize_mxfp4_into(out, packed.unflatten(-1, (packed.shape[-1] * 2 // group, group // 2)), scale)
    return out
