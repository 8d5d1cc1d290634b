"""Weights quantized to 4 bits on load (`quantize="nvfp4"`, `"mxfp4"`, `"int4:gN"`): the
destination that turns read full-precision slices into packed bytes and scales
(`PackedDest`), and lazyload's 4-bit holder (`Packed4Linear`), which keeps them packed and
dequantizes its weight per call.

MXFP4 and INT4 quantize each read box as it lands: its columns are whole groups of the
local tensor (the plan refuses a split that cuts one), whose scales depend on their own
bytes only. NVFP4's global scale comes from the amax of the whole tensor, so its boxes are
gathered (float32, one tensor at a time) until the last has landed, then quantized. A rank
holding a slice of it (world > 1 in a process group, `shared`) keeps its gathered slice in
the model's dtype until every rank has read (that slice's memory, as a load in full
precision holds it), then `quantize_shared` all-reduces (max) the ranks' amax of every
such tensor, one float32 vector under the load's deadline, and quantizes each slice with
the whole tensor's global scale: each rank's bytes are its slice of world 1's.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import wait_all
from ..plan import ReadItem
from ..targets import local_tensor
from .dequant import QuantizedBox
from .linear import DequantizingLinear
from .onload import chunk_rows, full_precision
from .pack4 import PER_WORD, STORED, dequantize_packed, nvfp4_global_scale, quantize_rows, scale_dtype, stored_shape

GLOBAL = "_global_scale"  # NVFP4: `X_global_scale` beside `X` and `X_scale`


class PackedDest:
    """The destination of a target quantized to 4 bits: packed `data`, `scale` per `group`
    input columns, `global_scale` (NVFP4), quantized from values in `full_dtype` (the dtype
    the model would hold them in: compressed-tensors quantizes from that). `items`: how many
    read items fill the target (NVFP4 quantizes once all have landed). `shared`: NVFP4 of a
    tensor whose amax is the max over the ranks' (quantized in `quantize_shared`)."""

    def __init__(self, scheme: str, shape: tuple[int, ...], group: int, full_dtype: torch.dtype,
                 device: torch.device, items: int, shared: bool = False):
        self.scheme, self.group, self.full_dtype, self.device = scheme, group, full_dtype, device
        self.shape = tuple(shape)
        self.data = torch.empty(stored_shape(shape, scheme), dtype=STORED[scheme], device=device)
        self.scale = torch.empty(shape[:-1] + (shape[-1] // group,), dtype=scale_dtype(scheme, full_dtype),
                                 device=device)
        self.global_scale = torch.empty(1, dtype=torch.float32, device=device) if scheme == "nvfp4" else None
        self._left, self._gathered, self._lock = items, None, threading.Lock()
        self.shared = shared

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def box(self, item: ReadItem) -> None:
        return None  # bytes never land as they are: they are quantized

    def place(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        self.write(item.dst_box, full_precision(item, source, self.device))

    def write(self, box: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
        if self.global_scale is None:
            return self._quantize(box, values)
        whole = tuple(box) == tuple((0, n) for n in self.shape)
        if whole and self._left == 1 and not self.shared:  # NVFP4 read in one box (the usual case): no gathering copy
            self._left = 0
            self.global_scale.copy_(nvfp4_global_scale(values.to(self.full_dtype).abs().amax()))
            return self._quantize(box, values)
        with self._lock:  # NVFP4: gather the whole local tensor first
            if self._gathered is None:
                self._gathered = torch.empty(self.shape, dtype=self.full_dtype, device=self.device)
            self._gathered[tuple(slice(a, b) for a, b in box)] = values
            self._left -= 1
            last = self._left <= 0
        if last and not self.shared:  # a shared one waits for the ranks' amax (`quantize_shared`)
            self.quantize_gathered(self._gathered.abs().amax())

    def local_amax(self) -> torch.Tensor:
        """The amax of this rank's gathered slice (in the model's dtype)."""
        return self._gathered.abs().amax()

    def quantize_gathered(self, amax: torch.Tensor) -> None:
        """Quantize the gathered tensor with the global scale of `amax`, then let it go."""
        whole, self._gathered = self._gathered, None
        self.global_scale.copy_(nvfp4_global_scale(amax.to(self.full_dtype)))
        self._quantize(tuple((0, n) for n in self.shape), whole)

    def _quantize(self, box: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
        """Quantize `values` (the whole-group `box` of the local 2-D tensor) a few rows at a time."""
        (r0, r1), (c0, c1) = box
        per, g = PER_WORD[self.scheme], self.group
        step = chunk_rows(self.device, c1 - c0)
        for r in range(0, r1 - r0, step):
            rows = values[r:r + step].to(self.full_dtype)
            packed, scale = quantize_rows(self.scheme, rows, g, self.global_scale)
            at = slice(r0 + r, r0 + r + rows.shape[0])
            self.data[at, c0 // per:c1 // per] = packed
            self.scale[at, c0 // g:c1 // g] = scale

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.full_dtype

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        out = {name: self.data, name + "_scale": self.scale}
        if self.global_scale is not None:
            out[name + GLOBAL] = self.global_scale
        return out

    def bytes_saved(self, full_dtype: torch.dtype) -> int:
        held = sum(t.nbytes for t in (self.data, self.scale, self.global_scale) if t is not None)
        return self.data.numel() * PER_WORD[self.scheme] * full_dtype.itemsize - held


def quantize_shared(dests: dict) -> None:
    """The NVFP4 targets whose amax the ranks share: one all-reduce (max) of this rank's
    amax of each (in name order, the same on every rank), bounded by the load's deadline
    (inside `Agreement.collectives`), then each quantized with its whole tensor's scale."""
    names = sorted(name for name, dest in dests.items() if isinstance(dest, PackedDest) and dest.shared)
    if not names:
        return
    device = dests[names[0]].device if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    amax = torch.stack([dests[name].local_amax().float().to(device) for name in names])
    wait_all([dist.all_reduce(amax, op=dist.ReduceOp.MAX, async_op=True)], "the NVFP4 amax all-reduce")
    for name, value in zip(names, amax.unbind()):
        dests[name].quantize_gathered(value.to(dests[name].device))


class Packed4Linear(DequantizingLinear):
    """y = x @ W.T + bias, W held as 4-bit packed `weight` (uint8 E2M1 pairs, or int32 words of
    eight INT4 values), `weight_scale` per `group` input columns and, for NVFP4,
    `weight_global_scale`; dequantized per call (this rank's shard under TP)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str, group: int,
                 compute_dtype: torch.dtype, device: torch.device | str | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.scheme, self.group = in_features, out_features, scheme, group
        self.compute_dtype = compute_dtype
        shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(stored_shape(shape, scheme), dtype=STORED[scheme], device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, in_features // group, device=device,
                                                     dtype=scale_dtype(scheme, compute_dtype)), requires_grad=False)
        if scheme == "nvfp4":
            self.weight_global_scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device),
                                                    requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device)) if bias else None

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision weight (this rank's shard under TP), in `dtype`."""
        global_scale = getattr(self, "weight_global_scale", None)
        return dequantize_packed(self.scheme, local_tensor(self.weight), local_tensor(self.weight_scale), self.group,
                                 None if global_scale is None else local_tensor(global_scale),
                                 dtype or self.compute_dtype)

    def held(self) -> str:
        return self.scheme


def swap_packed_linears(model: nn.Module, groups: dict[str, int], scheme: str) -> None:
    """Replace the named Linear layers (module name -> group) by Packed4Linear on meta."""
    for name, group in groups.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        setattr(parent, attr, Packed4Linear(old.in_features, old.out_features, old.bias is not None, scheme, group,
                                            old.weight.dtype, device="meta"))
