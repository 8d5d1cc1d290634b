"""4-bit checkpoints kept packed (`quantize="keep"`): MXFP4 experts in gpt-oss's layout held
as their stored blocks and scales instead of being dequantized on load; compressed-tensors'
NVFP4 / INT4 Linear weights held as stored in lazyload's `Packed4Linear` (compressed-tensors
0.20 has no `CompressedLinear` any more: it raises "no longer supported").

The model's experts module (`GptOssExperts`: `gate_up_proj` [E, K, R] in full precision)
becomes `Packed<class>` (an `Mxfp4Experts`), holding `X_blocks` uint8 [E, R, K/32, 16] and `X_scales` uint8
[E, R, K/32] under transformers' names (a `Mxfp4GptOssExperts`' state dict); for the duration
of each forward call its `_parameters` hold the dequantized [E, K, R] instead (the kernel of
lazyload's MXFP4 reader), one tensor's experts in full precision at a time. transformers'
own `Mxfp4GptOssExperts` runs only with triton kernels on a GPU; this holder runs anywhere.
A load reads the packed bytes as they are stored, whole 32-column groups per rank.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, PlanError
from ..expr import box_shape
from ..plan import ReadItem
from ..targets import local_tensor
from .dequant import QuantizedBox
from .fp4 import BLOCKS, E8M0_NAN, SCALES, dequantize_mxfp4_into
from .pack4 import PER_WORD
from .packed import PackedDest

MX_GROUP = 32


def kept_box(dst_box: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The box of the blocks [E, R, K/32] that a box of the module's [E, K, R] holds."""
    (e, (k0, k1), r) = dst_box
    return (e, r, (k0 // MX_GROUP, k1 // MX_GROUP))


class KeptMxfp4Dest:
    """The destination of an MXFP4 experts tensor kept packed: the local blocks and scales,
    filled with the stored bytes of each read box."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        e, k, r = shape
        self.device = device
        self.blocks = torch.empty((e, r, k // MX_GROUP, MX_GROUP // 2), dtype=torch.uint8, device=device)
        self.scales = torch.empty((e, r, k // MX_GROUP), dtype=torch.uint8, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def box(self, item: ReadItem) -> None:
        return None  # a quantized box: blocks and scales, placed by `place`

    def place(self, item: ReadItem, source: QuantizedBox) -> None:
        if bool((source.scale == E8M0_NAN).any()):
            raise CheckpointError(f"{item.scales.scale.key} ({item.scales.scale.file}): an MXFP4 scale is "
                                  f"{E8M0_NAN} (E8M0 NaN); the checkpoint is corrupt, every weight of its group is NaN.")
        at = tuple(slice(a, b) for a, b in kept_box(item.dst_box))
        self.blocks[at] = source.weight.reshape(box_shape(kept_box(item.dst_box)) + (MX_GROUP // 2,))
        self.scales[at] = source.scale.reshape(box_shape(kept_box(item.dst_box)))

    def write(self, box, values: torch.Tensor) -> None:
        raise PlanError(f"an MXFP4 tensor kept packed was given computed values for {box}, not its stored bytes "
                        "(a lazyload bug: please report it).")

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return {name + BLOCKS: self.blocks, name + SCALES: self.scales}

    def bytes_saved(self, full_dtype: torch.dtype) -> int:
        return self.blocks.numel() * 2 * full_dtype.itemsize - self.blocks.nbytes - self.scales.nbytes


class KeptPackedDest(PackedDest):
    """The destination of a compressed-tensors NVFP4 / INT4 Linear weight kept as stored:
    its packed data, its scales (in the checkpoint's dtype, which its dequantization rounds
    to) and its global scale, copied from each read box."""

    def place(self, item: ReadItem, source: QuantizedBox) -> None:
        (r0, r1), (c0, c1) = item.dst_box
        per, g = PER_WORD[self.scheme], self.group
        with self._lock:
            if self.scale.dtype != source.scale.dtype:
                self.scale = torch.empty(self.scale.shape, dtype=source.scale.dtype, device=self.device)
        self.data[r0:r1, c0 // per:c1 // per] = source.weight.reshape(r1 - r0, (c1 - c0) // per)
        self.scale[r0:r1, c0 // g:c1 // g] = source.scale.reshape(r1 - r0, (c1 - c0) // g)
        if self.global_scale is not None:
            self.global_scale.copy_(checked_global(source.glob, item.scales.glob.key))


def checked_global(value: torch.Tensor, key: str) -> torch.Tensor:
    """An NVFP4 global scale (it divides every scale), refused when zero, NaN or infinite."""
    scalar = value.reshape(1).float()
    if not bool(torch.isfinite(scalar).all()) or float(scalar) == 0.0:
        raise CheckpointError(f"{key}: the NVFP4 global scale is {float(scalar)}; it divides every scale, so the "
                              "weight would be inf or NaN. The checkpoint is corrupt or was never calibrated.")
    return scalar


class Mxfp4Experts(nn.Module):
    """Mixed into an experts module's class: each kept tensor `X` is held as `X_blocks` and
    `X_scales`; forward runs the class's own forward with `X` dequantized ([E, K, R])."""

    _lazyload_kept: dict[str, torch.dtype]  # X -> the dtype it computes in

    def dequantized(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        blocks, scales = local_tensor(self._parameters[name + BLOCKS]), local_tensor(self._parameters[name + SCALES])
        e, r, groups, _ = blocks.shape
        out = torch.empty((e, groups * MX_GROUP, r), dtype=dtype or self._lazyload_kept[name], device=blocks.device)
        dequantize_mxfp4_into(out.transpose(-1, -2), blocks, scales)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        try:
            for name, compute in self._lazyload_kept.items():
                self._parameters[name] = self.dequantized(name, compute if dtype is None else dtype)
            return super().forward(*args, **kwargs)
        finally:
            for name in self._lazyload_kept:
                self._parameters.pop(name, None)


_CLASSES: dict[type, type] = {}


def swap_kept_experts(model: nn.Module, names: list[str]) -> None:
    """Hold the named 3-D expert tensors as MXFP4 blocks and scales (on meta; the load fills
    them), their modules `Mxfp4Experts`."""
    for name in names:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        cls = type(module)
        if not issubclass(cls, Mxfp4Experts):
            cls = _CLASSES.setdefault(cls, type(f"Packed{cls.__name__}", (Mxfp4Experts, cls), {"__module__": __name__}))
            module.__class__ = cls
            module._lazyload_kept = {}
        old = module._parameters.pop(attr)
        e, k, r = old.shape
        module._lazyload_kept[attr] = old.dtype
        module.register_parameter(attr + BLOCKS, nn.Parameter(torch.empty(
            (e, r, k // MX_GROUP, MX_GROUP // 2), dtype=torch.uint8, device="meta"), requires_grad=False))
        module.register_parameter(attr + SCALES, nn.Parameter(torch.empty(
            (e, r, k // MX_GROUP), dtype=torch.uint8, device="meta"), requires_grad=False))


def kept_grids(exprs: dict, specs: dict, index, world: int, linears: set[str], placements: dict) -> dict:
    """Target name -> its grid, for every tensor the checkpoint stores packed in 4 bits that
    a holder keeps as stored: 3-D experts (world 1, or whole experts per rank: EP) in gpt-oss's MXFP4 layout (`expr.Mxfp4`
    pieces, transposed into the module's [E, K, R]), and the weights of the Linear layers
    `linears` in compressed-tensors' NVFP4 / INT4 (`expr.Packed4` pieces, no ops)."""
    from .onload import Grid

    out = {}
    for name, expr in exprs.items():
        shape = tuple(specs[name].shape)
        pieces = expr.pieces(tuple((0, n) for n in shape), index.shape_of)
        if not pieces or any(p.scales is None for p in pieces):
            continue
        codecs = {p.scales.codec for p in pieces}
        if len(shape) == 3 and codecs == {None} and all(
                index[p.key].dtype == torch.uint8 and p.scales.block[-1] == MX_GROUP
                and any(op[0] == "transpose" for op in p.ops) for p in pieces):
            out[name] = Grid(MX_GROUP, -2, True, 1, "mxfp4")
        elif name.rpartition(".")[0] in linears and len(codecs) == 1 and codecs <= {"nvfp4", "int4"} and not any(
                p.ops for p in pieces):
            out[name] = Grid(pieces[0].scales.block[-1], -1, True, 1, codecs.pop())
    experts = [name for name, grid in out.items() if grid.axis == -2 and not _whole_experts(placements.get(name))]
    if experts and world > 1:
        raise PlanError(f"quantize='keep' holds MXFP4 experts packed at world 1 or under EP only (each rank whole "
                        f"experts; {len(experts)} tensors are split otherwise, e.g. {experts[0]}); at world {world} "
                        "under TP load them dequantized (quantize=None), whose TP shards are whole groups.")
    return out


def kept_expert_styles(styles: dict[str, str], grids: dict) -> dict[str, str]:
    """Expert-parallel styles (name -> style) with each kept MXFP4 experts tensor `X` named as
    the module holds it: `X_blocks` and `X_scales`, both cut by expert as `X` would be (and
    no `X_scale`: the planned scale of a tensor quantized on load, which it has not)."""
    kept = {name for name, grid in grids.items() if grid.keep and grid.axis == -2}
    out = {}
    for name, style in styles.items():
        if name in kept:
            out.update({name + BLOCKS: style, name + SCALES: style})
        elif not (name.endswith("_scale") and name[:-len("_scale")] in kept):
            out[name] = style
    return out


def _whole_experts(placement) -> bool:
    """Whether a rank holds whole experts of a 3-D [E, K, R] tensor: replicated, or split
    along the experts dim only (EP); the blocks and scales are then cut alike."""
    return placement is None or placement.kind == "replicate" or (
        placement.kind == "shard" and placement.dim % 3 == 0)
