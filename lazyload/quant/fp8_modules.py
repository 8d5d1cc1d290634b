"""transformers' fine-grained FP8 layers (`FP8Linear`, `FP8Experts`) as load targets.

Such a layer holds `X` in float8 and `X_scale_inv` in float32, one entry per block of
`block_size` (128x128) of X's last two dims. From an FP8 block-scaled checkpoint both are
filled with the stored bytes (the model holds the pair itself: `formats.detect(held=...)`
leaves them undequantized) and the scale is split over ranks as its weight is
(`tp.runnable`), so a rank holds its slice of the weight and the scale blocks of it.

That is exact only when every rank's slice of a blocked dim starts on a block boundary and
ends on one (or at the dim's end): a slice that starts inside a block would need scale rows
that no split of the scale grid gives, and transformers' kernels take one scale per whole
block. Such a split is refused here, before any byte is read, naming the worlds that work.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Mapping

import torch
from torch import nn

from ..errors import PlanError
from ..expr import groups_of
from ..plan import REPLICATE, Placement, local_regions

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config and DeepSeek-V3's weight_block_size
MAX_WORLD = 128  # the worlds tried when naming those that work


def block_scaled_pairs(model: nn.Module, specs: Mapping) -> dict[str, tuple[int, ...]]:
    """FP8 weight name -> its block per dim, for every float8 model tensor `X` with a
    blocked `X_scale_inv` beside it (a per-tensor scalar scale needs no check)."""
    pairs = {}
    for name, spec in specs.items():
        scale = specs.get(name + SCALE_SUFFIX)
        if spec.dtype not in FP8_DTYPES or scale is None or len(scale.shape) != len(spec.shape):
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        block = tuple(getattr(module, "block_size", None) or DEFAULT_BLOCK)
        pairs[name] = (1,) * (len(spec.shape) - len(block)) + block
    return pairs


def scales_follow_weights(model: nn.Module, specs: Mapping, placements: Mapping[str, Placement]) -> dict:
    """Each FP8 layer's scale grid split as its weight (along the same dim, packed alike): a
    fused experts' `gate_up_proj_scale_inv` would otherwise get its module's style
    (`moe_tp_experts`), which leaves it whole beside a split weight."""
    return {name + SCALE_SUFFIX: placements[name] for name in block_scaled_pairs(model, specs) if name in placements}


def check_block_splits(model: nn.Module, specs: Mapping, placements: Mapping[str, Placement], rank: int,
                       world: int) -> None:
    """Refuse a split of an FP8 weight whose slices cut its scale blocks (module docstring)."""
    if world == 1:
        return
    for name, block in block_scaled_pairs(model, specs).items():
        scale = name + SCALE_SUFFIX
        check_block_split(name, tuple(specs[name].shape), block, placements.get(name, REPLICATE), rank, world,
                          tuple(specs[scale].shape), placements.get(scale, REPLICATE))


def check_block_split(name: str, shape: tuple[int, ...], block: tuple[int, ...], placement: Placement, rank: int,
                      world: int, scale_shape: tuple[int, ...] | None = None,
                      scale_placement: Placement | None = None) -> None:
    """Refuse, naming the worlds that work, a split whose rank slice of the FP8 weight `name`
    cuts a block of `block` (the scale grid: `scale_shape` split by `scale_placement`; by
    default the blocks' grid split as the weight, as quantize-on-load allocates it)."""
    if world == 1:
        return
    scale_shape = scale_shape or tuple(-(-n // b) for n, b in zip(shape, block))
    args = (shape, scale_shape, block, placement, _in_blocks(placement, block) if scale_placement is None
            else scale_placement)
    if not _splits_blocks(*args, rank, world):
        return
    works = [w for w in range(1, MAX_WORLD + 1) if w == 1 or not any(
        _splits_blocks(*args, r, w) for r in range(w))]
    raise PlanError(f"{name}: rank {rank} of {world} would hold a slice of this FP8 weight (shape "
                    f"{list(shape)}, scale blocks of {list(block[-2:])}) that starts or ends inside "
                    f"a block, whose one scale cannot be split. Use a world whose slices are whole blocks "
                    f"({', '.join(map(str, works))}), or keep this layer a plain Linear (transformers' "
                    "modules_to_not_convert) and load it dequantized.")


@lru_cache(maxsize=4096)  # one answer per layer kind, not per layer
def _in_blocks(placement: Placement, block: tuple[int, ...]) -> Placement:
    """The scale grid's placement split as the weight's: a box (a DTensor's, one rank's
    runs of indices) in blocks; other kinds split the grid as they split the weight."""
    if placement.kind != "box":
        return placement
    sizes = (1,) * (len(placement.spans) - len(block)) + tuple(block)
    return replace(placement, spans=tuple(groups_of(runs, (size,) * len(runs))
                                          for runs, size in zip(placement.spans, sizes)))


def _splits_blocks(shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, ...],
                   placement: Placement, scale_placement: Placement, rank: int, world: int) -> bool:
    """Whether this rank's slice of the weight cuts a block, or its scale slice is not the
    blocks of its weight slice."""
    try:
        _, regions = local_regions("", shape, placement, rank, world)
        _, scale_regions = local_regions("", scale_shape, scale_placement, rank, world)
    except PlanError:
        return True  # e.g. a scale grid that does not split evenly
    wanted = set()
    for region in regions:
        for (a, b), local, n, size in zip(region.global_box, region.local_start, shape, block):
            if a % size or local % size or (b % size and b != n):
                return True
        wanted.add((groups_of(region.global_box, block),
                    tuple(local // size for local, size in zip(region.local_start, block))))
    return wanted != {(r.global_box, r.local_start) for r in scale_regions}


def fp8_quantizer(model: nn.Module):
    """transformers' own FP8 quantizer when the model holds its FP8 layers (None otherwise):
    its `update_weight_conversions` gives each fused conversion (per-expert weights stacked
    into `FP8Experts.gate_up_proj`) a copy for the `_scale_inv` companions, as in
    `from_pretrained`, so the scales are stacked as their weights are."""
    if not any(type(m).__module__.endswith("finegrained_fp8") for m in model.modules()):
        return None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        return quantizer
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    return FineGrainedFP8HfQuantizer(FineGrainedFP8Config(), pre_quantized=True)


def scale_conversions(converts: list) -> list:
    """Of transformers' conversions (with `fp8_quantizer`'s), those that stack per-expert
    `_scale_inv` tensors into an FP8 layer's: a checkpoint scale they take is held by the
    model as stored, not a dequantization sibling of its weight."""
    return [c for c in converts if all(s.endswith(SCALE_SUFFIX) for s in c.sources)]


def swap_to_fp8_linears(model: nn.Module, names: list[str], block: int) -> None:
    """Replace the named Linear layers by transformers' `FP8Linear` (blocks of `block` x
    `block`, its bias in the layer's dtype) on the meta device; the load fills them."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        with torch.device("meta"):
            new = FP8Linear(old.in_features, old.out_features, block_size=(block, block), has_bias=old.bias is not None)
        if old.bias is not None:
            new.bias = nn.Parameter(torch.empty_like(old.bias, device="meta"), requires_grad=False)
        setattr(parent, attr, new)
