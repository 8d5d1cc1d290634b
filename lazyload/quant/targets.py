"""Which model tensors a load quantizes, with their scale grids (checked before any byte is
read), and the swap of their modules for quantized ones once every input check has passed:
Linear weights become `QuantizedLinear`, fused 3-D expert tensors a quantized experts module."""
from __future__ import annotations

from torch import nn

from ..index import CheckpointIndex
from ..plan import REPLICATE
from .experts import quantizable_experts, swap_experts
from .linear import quantizable_linears, swap_linears
from .fp8_modules import swap_to_fp8_linears
from .packed import swap_packed_linears
from .kept4 import kept_grids, swap_kept_experts
from .onload import BLOCK, KEEP, PACKED, Grid, Quantization, grid_for


def quantized_targets(model: nn.Module, config: Quantization | None, exprs: dict, specs: dict, placements: dict,
                      index: CheckpointIndex, rank: int, world: int, pieces_whole: bool = True) -> dict[str, Grid]:
    """Target name -> scale grid of each tensor `config` quantizes and the checkpoint fills;
    a TP split that would cut a scale group is refused here, before the model changes, and
    source pieces that would, unless `pieces_whole` is False (`grid_for`)."""
    if config is None:
        return {}
    if config.dtype == KEEP:
        return kept_grids(exprs, specs, index, world, set(quantizable_linears(model, config)), placements)
    axes = {f"{module}.weight": -1 for module in quantizable_linears(model, config)}
    if not config.packed:  # 4 bits: Linear layers only (fused experts stay in full precision)
        axes.update(quantizable_experts(model, config))
    return {name: grid_for(name, exprs[name], specs[name].shape, placements.get(name, REPLICATE), rank, world,
                           config, axis, lambda key: index[key].dtype, lambda key: index[key].shape, pieces_whole)
            for name, axis in axes.items() if name in exprs}  # a tensor not filled is left as it is


def scale_names(model: nn.Module, grids: dict[str, Grid]) -> dict[str, str]:
    """Each quantized tensor -> the scale parameter `swap_quantized` puts beside it: a
    block-quantized Linear's (transformers' FP8Linear) `weight_scale_inv`, else `X_scale`."""
    linear = lambda name: isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Linear)  # noqa: E731
    return {name: name + ("_scale_inv" if grid.rows > 1 and linear(name) else "_scale") for name, grid in grids.items()}


def saved_bytes(dests: dict, full_dtypes: dict) -> int:
    """Bytes the quantized targets (name -> QuantizedDest or PackedDest) hold less than they
    would in their full-precision dtype (name -> torch.dtype), their scales counted."""
    return sum(dest.bytes_saved(full_dtypes[name]) for name, dest in dests.items())


def swap_quantized(model: nn.Module, grids: dict[str, Grid], config: Quantization) -> None:
    """Swap the modules of the quantized targets (on meta; the load fills them)."""
    linears = {name.rpartition(".")[0]: grid for name, grid in grids.items()
               if isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Linear)}
    swap_kept_experts(model, [name for name, grid in grids.items()
                              if grid.keep and grid.packed and name.rpartition(".")[0] not in linears])
    grids = {name: grid for name, grid in grids.items() if not (grid.keep and grid.packed)}
    swap_to_fp8_linears(model, [name for name, grid in linears.items() if grid.rows > 1], BLOCK)
    for scheme in PACKED:
        swap_packed_linears(model, {name: grid.group for name, grid in linears.items() if grid.packed == scheme},
                            scheme)
    swap_linears(model, {name: grid.group for name, grid in linears.items() if grid.rows == 1 and not grid.packed},
                 config)
    swap_experts(model, {name: (grid.group, grid.axis) for name, grid in grids.items()
                         if name.rpartition(".")[0] not in linears}, config)
