"""Quantized on the wire: a box its target quantizes on arrival (`load_into(quantize=...)`'s
8-bit data and float32 scales) is quantized by its source before sending, by the same code
(`QuantizedDest.write`), so that only the 8-bit data and the scales travel (about a half of
bf16's bytes, a quarter of float32's) and the target copies them into place.

The same bytes as on arrival: a box whose input dim (and, for FP8 blocks, its rows) starts on
a scale group of the target's local tensor and ends on one or at its end holds whole groups,
each quantized from its own values alone, on whichever side. Other boxes (a conversion's
sources, a box its ops move, a pre-quantized source) travel in full precision, quantized on
arrival as before; so does a box whose source pieces cut a group or a block (FSDP shards
of 192 rows of 128-row FP8 blocks): its values wait in a full-precision scratch of the
target's local tensor until every such box has landed, and its groups are quantized then
(`AssembledDest`), as `load_into` quantizes them from whole groups."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..expr import Box, Whole, box_numel, box_shape, full_box
from ..placer import TensorDest
from ..quant.channel import quantize_rows
from ..quant.onload import Grid, QuantizedDest, scale_shape

SCALE = torch.float32  # the scales' dtype on the wire, as the target holds them


@dataclass(frozen=True)
class QuantizedWire:
    """How a source quantizes a box before sending it: to `dtype` (int8, float8_e4m3fn),
    `group` elements of the input dim `axis` per scale, and `rows` rows per scale (> 1:
    FP8 blocks). On the wire: the data, then its scales from the next 4-byte boundary; the
    whole starts on one (`itemsize`, the alignment `routes.packed_growth` counts)."""

    dtype: torch.dtype
    group: int
    axis: int = -1
    rows: int = 1
    itemsize: int = SCALE.itemsize

    def nbytes(self, box: Box) -> int:
        data = box_numel(box) * self.dtype.itemsize
        scales = box_numel(full_box(self._scale_shape(box))) * SCALE.itemsize
        return -(-data // SCALE.itemsize) * SCALE.itemsize + scales

    def _scale_shape(self, box: Box) -> tuple[int, ...]:
        return scale_shape(box_shape(box), self.group, self.axis, self.rows)

    def slots(self, buffer: torch.Tensor, offset: int, box: Box) -> tuple[torch.Tensor, torch.Tensor]:
        """The data and the scales of a box at `offset` of a message."""
        shape = box_shape(box)
        data_bytes = box_numel(box) * self.dtype.itemsize
        scales_at = offset + -(-data_bytes // SCALE.itemsize) * SCALE.itemsize
        scale = self._scale_shape(box)
        return (buffer[offset:offset + data_bytes].view(self.dtype).view(shape),
                buffer[scales_at:scales_at + box_numel(full_box(scale)) * SCALE.itemsize].view(SCALE).view(scale))

    def _dest(self, data: torch.Tensor, scale: torch.Tensor) -> QuantizedDest:
        return QuantizedDest(data, scale, self.group, self.axis, False, self.rows)

    def pack(self, buffer: torch.Tensor, offset: int, box: Box, values: torch.Tensor) -> None:
        """The source's side: `values` (the box, in full precision) quantized into the message."""
        data, scale = self.slots(buffer, offset, box)
        self._dest(data, scale).write(full_box(data.shape), values)

    def place(self, buffer: torch.Tensor, offset: int, src_box: Box, dest: QuantizedDest, dst_box: Box) -> None:
        """The target's side: the box's data and scales copied into `dst_box` of `dest`."""
        data, scale = self.slots(buffer, offset, src_box)
        dest.data[tuple(slice(a, b) for a, b in dst_box)].copy_(data)
        dest.scale[tuple(slice(a, b) for a, b in self._scale_box(dst_box))].copy_(scale)

    def source_box(self, box: Box) -> Box:
        """What the source reads to pack `box`: the box itself (its groups are whole)."""
        return box

    def _scale_box(self, box: Box) -> Box:
        """The scales of `box` (whole groups) in its tensor's scale grid (`scale_shape`)."""
        axis, last = self.axis % len(box), len(box) - 1
        return tuple((a // self.group, -(-b // self.group)) if d == axis
                     else (a // self.rows, -(-b // self.rows)) if d == last - 1 and self.rows > 1 else (a, b)
                     for d, (a, b) in enumerate(box))


@dataclass(frozen=True)
class ChannelWire(QuantizedWire):
    """A box of a weight stored quantized per output row in compressed-tensors' layout
    (`quant.channel`): its 8-bit data and a float32 scale per row, each row's scale taken
    over the whole row (`group`: the row's length), as the library writes it. The source
    reads the box's whole rows (`source_box`; its piece holds them, `BoxTarget` checks) and
    quantizes the box's columns: a row-parallel worker's half gets the row's own scale."""

    def source_box(self, box: Box) -> Box:
        return box[:-1] + ((0, self.group),)

    def pack(self, buffer: torch.Tensor, offset: int, box: Box, rows: torch.Tensor) -> None:
        """`rows`: the full-precision rows of `box` (`source_box`), quantized into the message."""
        data, scale = self.slots(buffer, offset, box)
        values, scales = quantize_rows(rows, self.dtype)
        data.copy_(values[..., box[-1][0]:box[-1][1]])
        scale.copy_(scales)


def quantize_on_wire(plan, items: list) -> dict[int, QuantizedWire]:
    """The items (by position) whose source quantizes them before sending: those of a target
    quantized on arrival into 8-bit data and scales (not kept as stored, not 4-bit packed,
    not a conversion's), read as they land (no ops, no pre-quantized source), whose box holds
    whole scale groups and blocks of the target's local tensor (`_whole_groups`)."""
    if plan.quantization is None:
        return {}
    local = {t.name: t.local_shape for t in plan.targets}
    out = {}
    for position, item in enumerate(items):
        grid = plan.quantized.get(item.target)
        if (grid is None or grid.keep or grid.packed or item.ops or item.scales is not None
                or isinstance(plan.mapping.exprs.get(item.target), Whole)
                or not _whole_groups(item.dst_box, local[item.target], grid)):
            continue
        out[position] = QuantizedWire(plan.quantization.torch_dtype, grid.group, grid.axis, grid.rows)
    return out


def _whole_groups(box: Box, shape: tuple[int, ...], grid: Grid) -> bool:
    """Whether `box` of a local tensor of `shape` starts on a scale group of its input dim (and
    a block's rows) and ends on one or at the tensor's end: its quantization is then that of
    the same groups of the whole tensor."""
    dims = [(grid.axis % len(box), grid.group)] + ([(len(box) - 2, grid.rows)] if grid.rows > 1 else [])
    return all(box[d][0] % size == 0 and (box[d][1] % size == 0 or box[d][1] == shape[d]) for d, size in dims)


class AssembledDest:
    """A quantized target some of whose boxes cut its scale groups or blocks (their source
    pieces do): those land in full precision in a scratch of the local tensor (float32, as a
    conversion's sources do), and once the last has landed, each one's box widened to whole
    groups and blocks is quantized from it (every value of a group a box cuts is in some box
    that cuts it too). Boxes of whole groups are quantized as they land, or were on the wire.
    Boxes land from one thread (a sync's); the lock is for a reader's threads alike."""

    def __init__(self, dest: QuantizedDest, shape: tuple[int, ...], cut: int):
        self.dest, self.shape, self._left, self._cut = dest, shape, cut, []
        self.data, self.scale, self.device = dest.data, dest.scale, dest.device
        self._grid = Grid(dest.group, dest.axis, False, dest.rows)
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()

    def box(self, item) -> None:
        return None

    def place(self, item, source: torch.Tensor) -> None:
        if _whole_groups(item.dst_box, self.shape, self._grid):
            return self.dest.place(item, source)
        with self._lock:
            if self._scratch is None:
                self._scratch = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        TensorDest(self._scratch).place(item, source)
        with self._lock:
            self._cut.append(item.dst_box)
            self._left -= 1
            last = not self._left
        if last:
            for box in self._cut:
                box = self._widened(box)
                self.dest.write(box, self._scratch[tuple(slice(a, b) for a, b in box)])
            self._scratch, self._cut = None, []

    def _widened(self, box: Box) -> Box:
        """`box` widened to whole groups of the input dim (and blocks' rows), within the tensor."""
        sizes = {self._grid.axis % len(box): self._grid.group}
        if self._grid.rows > 1:
            sizes[len(box) - 2] = self._grid.rows
        return tuple((a // sizes[d] * sizes[d], min(-(-b // sizes[d]) * sizes[d], self.shape[d])) if d in sizes
                     else (a, b) for d, (a, b) in enumerate(box))

    def write(self, box: Box, values: torch.Tensor) -> None:
        self.dest.write(box, values)

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return self.dest.tensors(name)


def with_assembled(dests: dict, plan, items: list) -> dict:
    """`dests` with each quantized target whose boxes cut its groups (`_whole_groups`) behind
    an `AssembledDest` (not a conversion's: it quantizes its whole result already)."""
    local = {t.name: t.local_shape for t in plan.targets}
    cut: dict[str, int] = {}
    for item in items:
        grid = plan.quantized.get(item.target)
        if (grid is not None and not grid.keep and not grid.packed and isinstance(dests[item.target], QuantizedDest)
                and not _whole_groups(item.dst_box, local[item.target], grid)):
            cut[item.target] = cut.get(item.target, 0) + 1
    return {**dests, **{name: AssembledDest(dests[name], local[name], n) for name, n in cut.items()}}


def wire_bytes(kind: torch.dtype | QuantizedWire, box: Box) -> int:
    """The bytes of `box` on the wire, as `kind`: a dtype's, or quantized."""
    return kind.nbytes(box) if isinstance(kind, QuantizedWire) else box_numel(box) * kind.itemsize
