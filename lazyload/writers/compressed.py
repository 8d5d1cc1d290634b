"""save_sharded(..., quantize=): a compressed-tensors checkpoint out, which transformers
(with the `compressed-tensors` package) and vLLM load, and lazyload reads back at any world.

Each Linear weight that `load_into(model, quantize=...)` would quantize is written as the
values that load gives: `X.weight` int8 (format "int-quantized") or float8_e4m3fn
("float-quantized") and `X.weight_scale` float32, one scale per output row and group of
`group_size` input columns (compressed-tensors' "group" strategy; "channel" with
`group_size=None`), computed by lazyload's own quantize-on-load kernel. Every other tensor
is copied as it is; the Linear layers left in full precision are the config's `ignore`.
compressed-tensors dequantizes `(q.to(scale.dtype) * scale).to(dtype)`, lazyload's formula,
so a float32 model loads exactly lazyload's dequantized weights (a bf16 one rounds its scales).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import ArgumentError
from ..expr import Source
from ..quant.onload import Grid, QuantizedDest, Quantization, quantize_into, scale_shape
from .compressed4 import FORMATS4, encode4, entries4, weights_config

FORMATS = {"int8": ("int", "int-quantized"), "fp8": ("float", "float-quantized")}


class Encoded(NamedTuple):
    """How one checkpoint tensor is written quantized: its 8-bit (or packed) dtype and scale
    group, and a 4-bit scheme (`writers.compressed4`)."""

    dtype: torch.dtype
    group: int
    scheme: str = ""


def encoded_weights(grids: dict[str, Grid], exprs: dict, shapes: dict, config: Quantization) -> dict[str, Encoded]:
    """Checkpoint tensor name -> Encoded, for the tensors the load quantizes (`grids`: the
    load's own `quant.targets.quantized_targets`) that are 2-D Linear weights the checkpoint
    stores whole under the model's name (a fused, converted or pre-quantized source stays
    as it is). A weight whose columns are no whole number of groups is refused:
    compressed-tensors' group strategy cannot hold its short last group."""
    out = {}
    for name, grid in grids.items():
        expr = exprs.get(name)
        if not isinstance(expr, Source) or expr.key != name or len(shapes[name]) != 2 or grid.rows != 1:
            continue
        cols = shapes[name][-1]
        if cols % grid.group:
            module = name.rpartition(".")[0]
            raise ArgumentError(f"{name}: {cols} input columns are no whole number of quantization groups of "
                                f"{grid.group}, which a compressed-tensors checkpoint cannot hold; pass "
                                f"quantize=Quantization({config.dtype!r}, group_size=G) with G dividing {cols}, or "
                                f"keep it in full precision (Quantization(skip=[{module!r}])).")
        out[name] = Encoded(config.torch_dtype, grid.group, grid.packed)
    return out


def entries(key: str, dtype: torch.dtype, shape: tuple[int, ...], encoded: Encoded | None) -> list[tuple]:
    """The (key, dtype, shape) the output file holds for one tensor: itself, or its 8-bit
    weight and float32 scales."""
    if encoded is None:
        return [(key, dtype, shape)]
    if encoded.scheme:
        return entries4(key, dtype, shape, encoded.scheme, encoded.group)
    return [(key, encoded.dtype, shape), (key + "_scale", torch.float32, scale_shape(shape, encoded.group))]


def encode(values: torch.Tensor, encoded: Encoded | None, global_scale: torch.Tensor | None = None
           ) -> list[torch.Tensor]:
    """The tensors `entries` describes, from the read full-precision values (`global_scale`:
    an NVFP4 weight's, shared with the projections fused with it)."""
    if encoded is None:
        return [values]
    if encoded.scheme:
        return encode4(values, encoded.scheme, encoded.group, global_scale)
    dest = QuantizedDest(torch.empty(values.shape, dtype=encoded.dtype),
                         torch.empty(scale_shape(tuple(values.shape), encoded.group), dtype=torch.float32),
                         encoded.group)
    quantize_into(dest, tuple((0, n) for n in values.shape), values)
    return [dest.data, dest.scale]


def quantization_config(model: nn.Module, quantized: dict[str, Encoded], config: Quantization) -> dict[str, Any]:
    """config.json's `quantization_config`, as compressed-tensors' `QuantizationConfig`
    serialises it: one group targeting Linear layers, the others listed in `ignore`."""
    if config.packed:
        fmt, weights = FORMATS4[config.packed], weights_config(config.packed, config.group_size)
    else:
        num_type, fmt = FORMATS[config.dtype]
        weights = {"num_bits": 8, "type": num_type, "symmetric": True, "dynamic": False,
                   "strategy": "group" if config.group_size else "channel", "group_size": config.group_size,
                   "observer": "minmax"}
    modules = {name.rpartition(".")[0] for name in quantized}
    ignore = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in modules]
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": fmt}},
            "ignore": ignore, "kv_cache_scheme": None}
