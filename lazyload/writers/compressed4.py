"""The 4-bit tensors of a compressed-tensors checkpoint written by `save_sharded(quantize=
"nvfp4" | "int4:gN")` (`lazyload reshard --quantize`), in compressed-tensors' own layout:

- `nvfp4-pack-quantized` (its NVFP4A16 preset: weights only): `X.weight_packed` uint8
  [out, in/2], `X.weight_scale` float8_e4m3fn [out, in/16], `X.weight_global_scale` float32
  [1]. The global scale is shared by the projections vLLM fuses (q/k/v of one attention,
  gate/up of one MLP: the smallest of theirs, as llm-compressor sets it), since vLLM's
  `CompressedTensorsW4A16Fp4` runs a fused layer with one global scale (`1 / max`).
- `pack-quantized` (W4A16): `X.weight_packed` int32 [out, in/8], `X.weight_scale` in the
  weight's dtype [out, in/G], `X.weight_shape` int64 [2].

The values are quantize-on-load's (`quant.pack4.quantize_rows`), bit for bit what
compressed-tensors' compressors make of the same weight and scales.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from ..quant.pack4 import STORED, nvfp4_global_scale, quantize_rows, scale_dtype, stored_shape

FORMATS4 = {"nvfp4": "nvfp4-pack-quantized", "int4": "pack-quantized"}
# Projections vLLM fuses into one layer, whose NVFP4 global scale must then be one.
FUSED = re.compile(r"^(.*)\.(?:(q_proj|k_proj|v_proj)|(gate_proj|up_proj))\.weight$")


def entries4(key: str, dtype: torch.dtype, shape: tuple[int, ...], scheme: str, group: int) -> list[tuple]:
    """(key, dtype, shape) of the tensors one 4-bit weight is written as."""
    out = [(key + "_packed", STORED[scheme], stored_shape(shape, scheme)),
           (key + "_scale", scale_dtype(scheme, dtype), tuple(shape[:-1]) + (shape[-1] // group,))]
    if scheme == "nvfp4":
        return out + [(key + "_global_scale", torch.float32, (1,))]
    return out + [(key + "_shape", torch.int64, (len(shape),))]


def encode4(values: torch.Tensor, scheme: str, group: int, global_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors `entries4` describes, from the weight in its own dtype."""
    if scheme == "nvfp4" and global_scale is None:
        global_scale = nvfp4_global_scale(values.abs().amax())
    packed, scale = quantize_rows(scheme, values, group, global_scale)
    if scheme == "nvfp4":
        return [packed, scale, global_scale]
    return [packed, scale, torch.tensor(list(values.shape), dtype=torch.int64)]


def shared_global_scales(layer: dict[str, torch.Tensor], schemes: dict[str, str]) -> dict[str, torch.Tensor]:
    """NVFP4 weight name -> its global scale, one for the projections vLLM fuses (`layer`:
    a layer's weights by name, all read)."""
    fused: dict[tuple, list[str]] = {}
    for name in layer:
        if schemes.get(name) != "nvfp4":
            continue
        m = FUSED.match(name)
        fused.setdefault((m.group(1), "qkv" if m.group(2) else "gate_up") if m else (name,), []).append(name)
    out = {}
    for names in fused.values():
        shared = torch.cat([nvfp4_global_scale(layer[n].abs().amax()) for n in names]).min().reshape(1)
        out.update({n: shared for n in names})
    return out


def weights_config(scheme: str, group: int) -> dict[str, Any]:
    """The `weights` of the config group, as compressed-tensors serialises its presets."""
    if scheme == "nvfp4":
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "observer": "minmax"}
    return {"num_bits": 4, "type": "int", "symmetric": True, "group_size": group, "strategy": "group",
            "dynamic": False, "observer": "minmax"}
