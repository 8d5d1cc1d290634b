"""Fused MoE experts quantized on load: which 3-D expert tensors quantize (and over which
dim each contracts), and the swap of their module for one that runs the model's own
experts forward on the dequantized tensors.

transformers holds the experts of Mixtral, Qwen3-MoE, DeepSeek-V3 and most other MoE models
as 3-D Parameters of one module (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) marked
by `@use_experts_implementation`, which records the layout: every implementation (eager,
batched_mm, grouped_mm) contracts the last dim, or dim 1 when `is_transposed` ([E, in, out],
GPT-OSS). Scales are per (expert, output row, group of input elements) as for a Linear
layer: the scale grid is the tensor's shape with its input dim divided by the group
(`gate_up_proj_scale` [E, 2I, ceil(H/g)]), so tensor-parallel styles shard weight and scale
alike. Experts modules without that marker (Llama 4's) stay in full precision: their
contraction dim is not declared.

The quantized module keeps its class's forward: the 8-bit Parameter stays under its own
name (`experts.gate_up_proj`, so TP plans, state dicts and lazyload's targets see it), and
for the duration of each forward call the module's `_parameters` hold the dequantized
tensors instead (what transformers' TP does with local shards), one dequantization per
tensor per call: a weight-only scheme, one layer's experts in full precision at a time.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..targets import local_tensor
from .dequant import dequantized
from .onload import Quantization, not_converted, scale_shape

SCALE = "_scale"  # `X_scale` holds the scales of the quantized tensor `X`


def input_axis(module: nn.Module) -> int | None:
    """The dim the module's experts forward contracts its 3-D tensors over: -1, or -2 for
    transposed ([E, in, out]) experts; None for a module whose layout is not declared."""
    if not hasattr(module, "is_transposed") or not hasattr(module, "has_gate"):  # @use_experts_implementation
        return None
    return -2 if module.is_transposed else -1


def quantizable_experts(model: nn.Module, config: Quantization) -> dict[str, int]:
    """Parameter name -> input axis of every 3-D floating expert tensor `config` quantizes
    (the experts module not skipped by its patterns or `modules_to_not_convert`)."""
    not_convert, out = not_converted(model), {}
    for module_name, module in model.named_modules():
        axis = input_axis(module)
        quantized_already = isinstance(module, QuantizedExperts)  # as a QuantizedLinear is no plain Linear
        if axis is None or quantized_already or not module_name or config.skips(module_name, not_convert):
            continue
        for attr, param in module.named_parameters(recurse=False):
            if param.ndim == 3 and param.is_floating_point():
                out[f"{module_name}.{attr}"] = axis
    return out


class QuantizedExperts(nn.Module):
    """Mixed into an experts module's class: `X` holds 8-bit values and `X_scale` float32
    scales for each quantized tensor `X`; forward runs the class's own forward with `X`
    dequantized. `_lazyload_quantized`: name -> (group, input axis, compute dtype)."""

    _lazyload_quantized: dict[str, tuple[int, int, torch.dtype]]

    def dequantized(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision tensor `name` (this rank's shard under TP), in `dtype`."""
        group, axis, compute = self._lazyload_quantized[name]
        return dequantized(local_tensor(self._parameters[name]), local_tensor(self._parameters[name + SCALE]),
                           group, axis, dtype or compute)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stored = {name: self._parameters[name] for name in self._lazyload_quantized}
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        try:
            for name in stored:
                self._parameters[name] = self.dequantized(name, dtype)
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(stored)


_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    if issubclass(cls, QuantizedExperts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Quantized{cls.__name__}", (QuantizedExperts, cls), {"__module__": __name__})
    return _CLASSES[cls]


def swap_experts(model: nn.Module, grids: dict[str, tuple[int, int]], config: Quantization) -> None:
    """Make the named expert tensors (name -> (scale group, input axis)) 8-bit with a scale
    Parameter beside each, on the meta device (the load fills them), and their modules
    quantized experts modules."""
    quantized: dict[str, dict[str, tuple[int, int, torch.dtype]]] = {}  # module -> its tensors, set once below
    for name, (group, axis) in grids.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        old = module._parameters[attr]
        shape = tuple(old.shape)
        module.__class__ = _quantized_class(type(module))
        quantized.setdefault(module_name, {})[attr] = (group, axis, old.dtype)
        module._lazyload_quantized = quantized[module_name]
        module._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=config.torch_dtype, device="meta"),
                                                requires_grad=False)
        module.register_parameter(attr + SCALE, nn.Parameter(
            torch.empty(scale_shape(shape, group, axis), dtype=torch.float32, device="meta"), requires_grad=False))
