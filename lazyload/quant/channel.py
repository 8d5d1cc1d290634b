"""compressed-tensors' per-channel 8-bit weights, as its presets FP8_DYNAMIC (float8_e4m3fn)
and W8A8 (int8) store them: `X.weight` in 8 bits and `X.weight_scale`, one scale per output
row ([rows, 1]), symmetric. An engine serving such a checkpoint is updated from a trainer's
full-precision weights quantized the way the library writes them (`sync/wire.ChannelWire`),
so that the update equals a fresh load of the checkpoint it would write.

The library's math (`calculate_qparams`, then `quantize` in the naive compressor), which is
not `load_into(quantize=)`'s: computed in the weight's own dtype; the scale is the row's
absolute maximum over half the quantized range (448 for FP8; 127.5 for int8, whose range is
[-128, 127]); a zero scale becomes the dtype's eps; the data is `clamp(w / scale + 0)` (its
zero point, which stores -0.0 as +0.0), rounded
to the nearest integer for int8 and cast for FP8."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ArgumentError

RANGE = {torch.float8_e4m3fn: (-448.0, 448.0), torch.int8: (-128.0, 127.0)}  # its calculate_range
SCALE_SUFFIX = "_scale"  # X.weight's scales are X.weight_scale


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(data in `dtype`, scales [rows, 1] in the rows' dtype) of whole rows of a weight, as
    compressed-tensors quantizes them per channel (bit for bit, see the module)."""
    low, high = RANGE[dtype]
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    largest = torch.max(rows.amin(-1, keepdim=True).minimum(zero).abs(), rows.amax(-1, keepdim=True).maximum(zero))
    scale = largest / (torch.tensor(high - low, device=rows.device).to(rows.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(rows.dtype).eps, dtype=rows.dtype), scale)
    scaled = (rows / scale + 0.0).clamp_(low, high)  # + its zero point, 0: a -0.0 stored as +0.0
    if not dtype.is_floating_point:
        scaled.round_()
    return scaled.to(dtype), scale


def channel_dtype(quantization_config: Any) -> torch.dtype | None:
    """The 8-bit dtype of a compressed-tensors checkpoint quantized per channel (every config
    group: symmetric 8-bit int or float weights, one static scale per row), from its config's
    `quantization_config`; None for a checkpoint not quantized. Any other quantization is an
    ArgumentError naming it: the update cannot write its stored layout."""
    if not quantization_config:
        return None
    config = dict(quantization_config)
    method = config.get("quant_method")
    groups = list((config.get("config_groups") or {}).values())
    kinds = {(w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("symmetric"), bool(w.get("dynamic")),
              group.get("format") or config.get("format")) for group in groups for w in [group.get("weights") or {}]}
    supported = {("float", 8, "channel", True, False, "float-quantized"): torch.float8_e4m3fn,
                 ("int", 8, "channel", True, False, "int-quantized"): torch.int8}
    if method != "compressed-tensors" or len(kinds) != 1 or next(iter(kinds)) not in supported:
        raise ArgumentError(f"lazyload's weight update into a quantized engine writes compressed-tensors' per-channel "
                            f"8-bit weights (its FP8_DYNAMIC and W8A8 presets: symmetric, a scale per row); this "
                            f"checkpoint is quantized otherwise (quant_method {method!r}, weights "
                            f"{sorted(kinds, key=str)}): update it from a checkpoint on disk (reload_weights).")
    return supported[next(iter(kinds))]
