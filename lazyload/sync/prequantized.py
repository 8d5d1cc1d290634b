"""A target that holds quantized Linear layers already (loaded with `load_into(quantize=...)`:
lazyload's `QuantizedLinear`, transformers' block-FP8 `FP8Linear`): the sync plans it as the
full-precision model it was loaded from (each quantized layer stood in for, while planning,
by a plain Linear on meta of the same split), then quantizes each received box into the
layer's own 8-bit data and scales, in place. The quantization `quantize=` asks for must be
the one the layers hold: a layer that differs is named at construction, as is one whose
holder cannot be filled in place (4-bit `Packed4Linear`, a torchao tensor subclass)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from ..errors import ArgumentError
from ..quant.onload import QuantizedDest, Quantization, scale_shape
from ..targets import local_tensor


def refuse_unsupported_holders(model: nn.Module) -> None:
    """A target layer whose weight cannot be filled in place (4-bit packed data, a torchao
    tensor subclass) fails at construction, named, with what to do instead."""
    from ..quant.packed import Packed4Linear

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        holder = type(local_tensor(weight)) if isinstance(weight, torch.Tensor) else None
        if isinstance(module, Packed4Linear):
            held, load = f"4-bit packed weights ({type(module).__name__}, {module.scheme})", "quantize='int8' or 'fp8'"
        elif holder is not None and holder.__module__.startswith("torchao"):
            held, load = f"a torchao-quantized weight ({holder.__name__})", "quantize=Quantization('int8' or 'fp8', torchao=False)"
        else:
            continue
        raise ArgumentError(f"WeightSync: target layer {name!r} holds {held}; syncing into that holder is not "
                            f"supported. Load the target with load_into({load}) and sync with the same quantize=, "
                            "or sync into a target built on the meta device with quantize=... (the first sync "
                            "quantizes it).")


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's Linear layers whose weights are held quantized (8-bit data beside scales)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (hasattr(m, "weight_scale") or hasattr(m, "weight_scale_inv"))}


def _stand_in(layer: nn.Module, dtype: torch.dtype) -> nn.Linear:
    """A plain Linear on meta with the layer's full shape and split, in `dtype`."""
    weight = layer.weight
    local = torch.empty(local_tensor(weight).shape, dtype=dtype, device="meta")
    if hasattr(weight, "device_mesh"):  # a DTensor: the same placements over the same mesh
        from torch.distributed.tensor import DTensor

        local = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                   shape=weight.shape, stride=weight.stride())
    with torch.device("meta"):
        plain = nn.Linear(layer.in_features, layer.out_features, bias=False)
    plain.weight = nn.Parameter(local, requires_grad=False)
    plain.bias = layer.bias
    return plain


@contextmanager
def planned_as_full(model: nn.Module, layers: dict[str, nn.Module], dtype: torch.dtype) -> Iterator[None]:
    """`model` with each quantized layer stood in for by a plain one while planning; the
    layers are put back whatever happens."""
    for name, layer in layers.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _stand_in(layer, dtype))
    try:
        yield
    finally:
        for name, layer in layers.items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)


def full_dtype(model: nn.Module, layers: dict[str, nn.Module]) -> torch.dtype:
    """The dtype the quantized layers compute in (their full-precision weights')."""
    for layer in layers.values():
        if getattr(layer, "compute_dtype", None) is not None:
            return layer.compute_dtype
        if layer.bias is not None:
            return layer.bias.dtype
    kept = [p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1]
    return kept[0] if kept else torch.get_default_dtype()


def _held(layer: nn.Module) -> str:
    scale = getattr(layer, "weight_scale", None)
    scale = getattr(layer, "weight_scale_inv") if scale is None else scale
    return f"{type(layer).__name__}, {local_tensor(layer.weight).dtype}, scales {list(local_tensor(scale).shape)}"


def in_place_dests(plan, layers: dict[str, nn.Module], scale_name: Callable[[str], str]) -> dict[str, QuantizedDest]:
    """Each quantized target's destination over its layer's own data and scales, after
    checking that the layer holds the quantization the plan makes (dtype, scale grid)."""
    config: Quantization | None = plan.quantization
    wanted = {name.rpartition(".")[0] for name in plan.quantized}
    for name in layers:
        if name not in wanted:
            raise ArgumentError(f"WeightSync: target layer {name!r} is quantized ({type(layers[name]).__name__}), but "
                                f"quantize={None if config is None else config.dtype!r} keeps it in full precision: "
                                "pass the quantize= the target was loaded with.")
    dests = {}
    for target, grid in plan.quantized.items():
        layer = layers.get(target.rpartition(".")[0])
        scale = getattr(layer, scale_name(target).rpartition(".")[2], None) if layer is not None else None
        data = local_tensor(layer.weight) if layer is not None else None
        want = scale_shape(tuple(data.shape), grid.group, grid.axis, grid.rows) if data is not None else None
        if (scale is None or grid.packed or grid.keep or data.dtype != config.torch_dtype
                or tuple(local_tensor(scale).shape) != want):
            held = "full precision" if layer is None else _held(layer)
            raise ArgumentError(f"WeightSync: target layer {target.rpartition('.')[0]!r} holds {held}, but quantize="
                                f"{config.dtype!r} (group {grid.group}, {grid.rows} row(s) per scale) makes "
                                f"{config.torch_dtype}, scales {want}: pass the quantize= the target was loaded with.")
        dests[target] = QuantizedDest(data, local_tensor(scale), grid.group, grid.axis, False, grid.rows)
    return dests
