"""A weight-only quantized Linear layer, and the swap of a model's Linear layers for it.
(`DequantizingLinear` is its forward and repr, shared with `quant.packed.Packed4Linear`.)

`QuantizedLinear` holds its weight as stored 8-bit values (int8 or float8) with float32
scales on a (rows, ceil(in / group)) grid, and dequantizes it in forward (exactly, with the
kernel that dequantizes pre-quantized checkpoints), then runs `F.linear`. It is an
`nn.Linear` (so transformers' TP styles run it with local shards, and the model's
`out_features` / `in_features` bookkeeping holds); under tensor parallelism its weight and
scale are DTensors with the same placement, and forward sees their local shards.

`to_torchao` turns the layers torchao 0.18 can hold (whole groups) into plain `nn.Linear`
layers whose weight is torchao's `Int8Tensor` / `Float8Tensor`, built from the same data and
scales (its dequantization gives the same values). torchao does not take a short last group
(int8 refuses it, fp8 dequantizes it wrongly); those layers stay `QuantizedLinear`.

Under tensor parallelism the torchao tensor is the rank's local shard in a plain `nn.Linear`
(local sizes), not the local tensor of a DTensor: torchao 0.18's `Int8Tensor` implements
neither `aten.view` (`DTensor.from_local` calls `view_as`) nor `aten.t` (DTensor runs
`F.linear` as `t` + `mm` on the local tensor), on any device. transformers' TP styles run an
`nn.Linear` at inference on its local tensors anyway, so the local form is what runs: a
column-parallel layer's output is the rank's slice (as transformers' colwise gives it), a
row-parallel layer sums its partial output over the mesh and adds its bias once
(`tp.runnable.install_rowwise`, as `parallelize` does for plain row-parallel layers). Only
layers whose split runs that way change holder (`parallel_role`); the others stay
`QuantizedLinear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..targets import is_dtensor, local_tensor
from ..tp.runnable import install_rowwise
from .dequant import dequantized
from .onload import Quantization, not_converted, scale_shape


class DequantizingLinear(nn.Linear):
    """An `nn.Linear` whose weight is held quantized (with `group` inputs per scale) and
    dequantized per call by the subclass's `dequantized_weight(dtype)` (this rank's shard
    under TP); `held` says how the weight is held, for its repr."""

    _hf_quantized_needs_local_tp = True  # transformers' TP: forward gets local shards
    group: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.held()}, group={self.group}")


class QuantizedLinear(DequantizingLinear):
    """y = x @ dequantize(weight, weight_scale).T + bias, weight 8-bit, scales float32:
    `weight_scale[r, j]` multiplies `weight[r, j*group:(j+1)*group]`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: int, qdtype: torch.dtype,
                 compute_dtype: torch.dtype, device: torch.device | str | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=qdtype, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape((out_features, in_features), group),
                                                     dtype=torch.float32, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device))
                     if bias else None)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision weight (this rank's shard under TP), in `dtype`."""
        return dequantized(local_tensor(self.weight), local_tensor(self.weight_scale), self.group, -1,
                           dtype or self.compute_dtype)

    def held(self) -> str:
        return f"weight={self.weight.dtype}"


def quantizable_linears(model: nn.Module, config: Quantization) -> list[str]:
    """Names of the Linear layers `config` quantizes: every plain `nn.Linear` not skipped
    by its patterns or the model config's `modules_to_not_convert`."""
    skipped = not_converted(model)
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and name and not config.skips(name, skipped)]


def swap_linears(model: nn.Module, groups: dict[str, int], config: Quantization) -> dict[str, QuantizedLinear]:
    """Replace the named Linear layers by QuantizedLinear layers (module name -> scale
    group) on the meta device (their tensors are filled by the load). Returns name -> new module."""
    swapped = {}
    for name, group in groups.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        new = QuantizedLinear(old.in_features, old.out_features, old.bias is not None,
                              group, config.torch_dtype, old.weight.dtype,
                              device="meta")
        setattr(parent, attr, new)
        swapped[name] = new
    return swapped


def to_torchao(model: nn.Module, names: list[str], styles: dict[str, str] | None = None) -> list[str]:
    """Replace the named QuantizedLinear layers that torchao can hold by nn.Linear layers
    with an Int8Tensor / Float8Tensor weight (under TP: the rank's local shard, see the
    module docstring). `styles`: module name -> the transformers TP style the load ran it
    with (its `ParallelPlan`). Returns the names replaced."""
    from torchao.quantization import Float8Tensor, Int8Tensor

    replaced = []
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if not isinstance(old, QuantizedLinear):
            continue
        weight, scale = local_tensor(old.weight.data), local_tensor(old.weight_scale.data)
        role = parallel_role(old, (styles or {}).get(name))
        if role is None or weight.shape[-1] % old.group:
            continue
        cls = Int8Tensor if weight.dtype == torch.int8 else Float8Tensor
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        new.weight = nn.Parameter(cls(weight, scale, [1, old.group], dtype=old.compute_dtype), requires_grad=False)
        new.bias = None if old.bias is None else nn.Parameter(local_tensor(old.bias.data), requires_grad=False)
        if role == "rowwise":
            install_rowwise(new, old.weight.device_mesh)
        setattr(parent, attr, new)
        replaced.append(name)
    return replaced


def parallel_role(layer: QuantizedLinear, style: str | None = None) -> str | None:
    """How a plain nn.Linear holding the layer's local tensors runs as it did: "local" (world
    1, or a plain shard that runs as it is), "rowwise" (transformers' "rowwise": partial
    outputs summed over the mesh), or None (any other split or forward hook, e.g.
    "colwise_gather_output", a user's own parallelize_module: left as it is). `style`: the
    transformers style the load ran the layer with, None for none."""
    if layer._forward_hooks or layer._forward_pre_hooks:
        return None
    if is_dtensor(layer.weight):
        return {"colwise": "local", "rowwise": "rowwise"}.get(style)
    return "local" if style is None and "forward" not in vars(layer) else None
