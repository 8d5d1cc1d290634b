"""Placer: destination tensors, copies into them, and assignment into the module.

Destinations are allocated once per target (or the model's own tensor is reused when it is
already real, of the right shape, dtype and device: a load into a real model overwrites it in
place). Assignment replaces every module attribute that held the old tensor, so weights
tied before the load (the same Parameter under two names) are tied after it. A target
computed by an operation no box goes through (`expr.Whole`) gets its sources whole first
(`WholeDest`).
"""
from __future__ import annotations

import math
import threading
from typing import Collection, Protocol

import torch
from torch import nn

from .expr import Box, Whole, apply_ops, box_shape, undo_ops
from .plan import ReadItem, TargetPlan
from .quant.dequant import QuantizedBox, dequantize_into
from .quant.onload import Grid, QuantizedDest, scale_shape
from .quant.kept4 import KeptMxfp4Dest, KeptPackedDest
from .quant.packed import PackedDest
from .readers import byte_runs
from .targets import Slot, current_tensor, is_dtensor, local_tensor


def allocate_quantized(target: TargetPlan, grid: Grid, device: torch.device, full_dtype: torch.dtype,
                       items: int) -> QuantizedDest | PackedDest:
    """8-bit data and float32 scales for a target quantized on load, or 4-bit packed data
    and scales (`grid.packed`) quantized from `full_dtype` values, filled by `items` reads."""
    if grid.packed and grid.keep:
        if len(target.local_shape) == 3:
            return KeptMxfp4Dest(target.local_shape, device)
        return KeptPackedDest(grid.packed, target.local_shape, grid.group, full_dtype, device, items)
    if grid.packed:
        return PackedDest(grid.packed, target.local_shape, grid.group, full_dtype, device, items, grid.shared_amax)
    scale = torch.empty(scale_shape(target.local_shape, grid.group, grid.axis, grid.rows), dtype=torch.float32, device=device)
    return QuantizedDest(torch.empty(target.local_shape, dtype=target.dtype, device=device), scale, grid.group, grid.axis,
                         grid.keep, grid.rows)


def allocate(target: TargetPlan, slot: Slot, device: torch.device) -> TensorDest:
    """The model's own tensor when it is real and fits (filled in place), else a new one."""
    if fills_in_place(target, slot, device):
        return TensorDest(local_tensor(current_tensor(slot)).data)
    return TensorDest(torch.empty(target.local_shape, dtype=target.dtype, device=device))


def fills_in_place(target: TargetPlan, slot: Slot, device: torch.device) -> bool:
    """Whether the model's own tensor is the target's destination: on `device`, of its
    dtype and local shape, contiguous (nothing new is allocated for it)."""
    existing = local_tensor(current_tensor(slot))
    return (existing.device == device and existing.dtype == target.dtype
            and tuple(existing.shape) == target.local_shape and existing.is_contiguous())


def viewable(targets: list[TargetPlan], items: list[ReadItem], slots: dict[str, Slot]) -> dict[str, ReadItem]:
    """Targets that can be views of the checkpoint's file mapping instead of copies (what
    `from_pretrained` does on CPU), with their one item: a meta target filled by one
    contiguous run of a source of its own dtype."""
    by_target: dict[str, list[ReadItem]] = {}
    for item in items:
        by_target.setdefault(item.target, []).append(item)
    views = {}
    for target in targets:
        own = by_target.get(target.name, [])
        if len(own) != 1 or not local_tensor(current_tensor(slots[target.name])).is_meta:
            continue
        item = own[0]
        if (item.entry.dtype != target.dtype or any(op[0] == "transpose" for op in item.ops)
                or item.scales is not None  # a dequantized weight is computed, never a view
                or item.entry.start % item.entry.itemsize  # bytes not aligned to the dtype cannot be viewed as it
                or box_shape(item.dst_box) != target.local_shape or len(byte_runs(item)[0]) != 1):
            continue
        views[target.name] = item
    return views


def whole_scratch(exprs: dict, shapes: dict, dtypes: dict, quantized: Collection[str], shape_of) -> dict[str, int]:
    """Targets computed from whole sources (`expr.Whole`) -> the bytes each holds at most
    while it is computed: its sources and its full result, in its scratch dtype."""
    out = {}
    for name, expr in exprs.items():
        if isinstance(expr, Whole):
            numel = sum(math.prod(s.shape(shape_of)) for _, s in expr.sources) + math.prod(shapes[name])
            out[name] = numel * (torch.float32 if name in quantized else dtypes[name]).itemsize
    return out


class Destination(Protocol):
    """How a target's read items land: a plain tensor (`TensorDest`), 8-bit data and scales
    quantized on load (`quant.onload.QuantizedDest`), or scratch for a conversion run on whole
    sources (`WholeDest`). The engine and the loader know destinations by this alone."""

    device: torch.device

    def box(self, item: ReadItem) -> torch.Tensor | None:
        """The item's box, where its bytes may land as they are (a plain tensor of the
        target's dtype); None when they must be converted first."""

    def place(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        """Write the item's source (after its ops; dequantized when it has scales) into its
        box, casting; `source` is on the destination's device."""

    def write(self, box: Box, values: torch.Tensor) -> None:
        """Full-precision values of `box` of the local tensor (a conversion's result)."""

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype whole sources are gathered in for a target of `dtype`."""

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Model tensor name -> value to assign, once every item has landed."""


class TensorDest:
    """A plain destination tensor (allocated, the model's own, or a view of the file mapping)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.device = tensor.device

    def box(self, item: ReadItem) -> torch.Tensor:
        return self.tensor[tuple(slice(a, b) for a, b in item.dst_box)]

    def place(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        if item.scales is not None:
            return dequant_into(self.tensor, item, source)
        self.box(item).copy_(apply_ops(source, item.ops))

    def write(self, box: Box, values: torch.Tensor) -> None:
        self.tensor[tuple(slice(a, b) for a, b in box)].copy_(values)

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # from_pretrained casts the sources to the target's dtype before converting

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return {name: self.tensor}


class WholeDest:
    """The destination of a target computed from whole sources (`expr.Whole`): each read item
    lands in its source's scratch tensor; once the last of its `items` has
    landed, the operation runs on the full tensors, the rank's regions of the result are
    written into `dest`, and the scratch is dropped. Items land from several reader threads."""

    def __init__(self, dest: Destination, expr: Whole, target: TargetPlan, items: int, shape_of):
        self.dest, self.expr, self.target = dest, expr, target
        self.device = dest.device
        self._dtype = dest.scratch_dtype(target.dtype)
        self._shapes = [s.shape(shape_of) for _, s in expr.sources]
        self._scratch: list[torch.Tensor | None] = [None] * len(self._shapes)
        self._left = items
        self._lock = threading.Lock()

    def box(self, item: ReadItem) -> None:
        return None  # sources land in scratch, not in the target

    def place(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        i = self.expr.position(item.entry.key)
        with self._lock:
            if self._scratch[i] is None:
                self._scratch[i] = torch.empty(self._shapes[i], dtype=self._dtype, device=self.device)
            scratch = self._scratch[i]
        TensorDest(scratch).place(item, source)
        with self._lock:
            self._left -= 1
            last = not self._left
        if last:
            self._finish()

    def _finish(self) -> None:
        with torch.no_grad():
            full = self.expr.compute(self._scratch)
        self._scratch = []
        for region in self.target.regions:
            values = full[tuple(slice(a, b) for a, b in region.global_box)]
            self.dest.write(tuple((s, s + b - a) for (a, b), s in zip(region.global_box, region.local_start)), values)

    def write(self, box: Box, values: torch.Tensor) -> None:
        self.dest.write(box, values)

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self._dtype

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return self.dest.tensors(name)


def with_whole(dests: dict[str, Destination], targets: list[TargetPlan], exprs: dict, items: list[ReadItem],
               shape_of) -> dict[str, Destination]:
    """`dests` with each target computed from whole sources behind its `WholeDest`."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.target] = counts.get(item.target, 0) + 1
    return {**dests, **{t.name: WholeDest(dests[t.name], exprs[t.name], t, counts[t.name], shape_of)
                        for t in targets if isinstance(exprs[t.name], Whole)}}


def copy_into(dest: Destination, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
    """Write the item's source tensor into its box of `dest` (see `Destination.place`);
    `source` is on dest's device (host-to-device copies are the engine's)."""
    dest.place(item, source)


def dequant_into(dest: torch.Tensor, item: ReadItem, source: QuantizedBox) -> None:
    """Dequantize the item's weight box with its scale blocks straight into its box of
    `dest` (seen through the inverse of its ops), exactly and without a full-size temporary."""
    view = undo_ops(dest[tuple(slice(a, b) for a, b in item.dst_box)], item.ops)
    start = tuple(a for a, _ in item.src_box)
    dequantize_into(view, source, start, item.scales.block, item.scales.codec)


def assign(slot: Slot, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the slot's tensor in every module that holds it. A DTensor
    slot gets a DTensor again, `tensor` being its local shard (same mesh and placements)."""
    current = current_tensor(slot)
    local = local_tensor(current)
    value = None
    if not local.is_meta and local.data_ptr() == tensor.data_ptr():
        value = current  # filled in place (a real model, or FSDP2 parameters after to_empty)
    elif is_dtensor(current):
        from torch.distributed.tensor import DTensor

        tensor = DTensor.from_local(tensor, current.device_mesh, current.placements, run_check=False,
                                    shape=current.shape, stride=current.stride())
    if value is None:
        value = nn.Parameter(tensor, requires_grad=slot.requires_grad) if slot.is_parameter else tensor
    for module, attr in slot.owners:  # a declared tie held apart (AutoTP re-made lm_head) shares it again
        store = module._parameters if slot.is_parameter else module._buffers
        if store.get(attr) is not value:
            store[attr] = value
