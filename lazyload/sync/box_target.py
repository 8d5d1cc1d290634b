"""A sync target given as the boxes it asks for rather than as a model: an inference engine
whose own weight loaders decide which box of each checkpoint tensor a worker holds (vLLM's
workers, `integrations.vllm_update`). Every box is received into a host tensor of its own,
allocated once and refilled by each sync; the engine then copies from those (`received`),
so a failed sync leaves the engine's weights as they were."""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch

from ..errors import ArgumentError
from ..expr import Box, Whole, box_shape, box_within
from ..index import CheckpointIndex
from ..placer import TensorDest, with_whole
from ..plan import ReadItem, plan_boxes
from ..planner import byte_budget
from ..quant.channel import SCALE_SUFFIX
from ..schedule import schedule
from .split import cut_item
from .wire import ChannelWire


class BoxTarget:
    """`WeightSync(target=BoxTarget(boxes))`: `boxes` are (tensor name, box) pairs, a box
    being per dim the (start, stop) of the tensor this rank receives, in the names the
    sources hold (a Hugging Face checkpoint's, for an HF trainer).

    `quantized` (torch.float8_e4m3fn or torch.int8): the engine stores its weights quantized
    per channel in compressed-tensors' layout (`quant.channel`): a box of `X.weight` asked
    for with the box of `X.weight_scale` of the same rows (`[rows, (0, 1)]`) is received as
    that 8-bit data and those float32 scales, quantized by the source rank from its
    full-precision `X.weight` (`wire.ChannelWire`), which must hold whole rows of it."""

    def __init__(self, boxes: Iterable[tuple[str, Box]], quantized: torch.dtype | None = None):
        self.boxes = list(dict.fromkeys((name, tuple(tuple(span) for span in box)) for name, box in boxes))
        self.quantized = quantized
        self.values: dict[tuple[str, Box], torch.Tensor] = {}
        self.stored: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # name -> (shape, dtype) the engine holds
        self._held: dict[str, list[tuple[Box, torch.Tensor]]] = {}  # name -> its boxes' values: a lookup per copy

    def plan(self, index: CheckpointIndex, max_host_bytes: int | None,
             limit_of: Callable[[ReadItem], int | None] = lambda item: None) -> tuple[list, dict, int, dict]:
        """(read items in layer order, their destinations, the byte budget, the items (by
        position) quantized on the wire) over the sources' index, each item larger than
        `limit_of(item)` bytes cut (`split.cut_item`); a box that no source holds, or a
        quantized one its sources cannot quantize, is an ArgumentError naming it, before
        any byte moves."""
        scales = self._scale_boxes()
        scale_boxes, names = set(scales.values()), set(index.names())
        for name, box in self.boxes:
            if (name, box) not in scale_boxes:
                _check_box(index, names, name, box)
        weights, scale_names = {name for name, _ in scales}, {name for name, _ in scale_boxes}
        self.stored = {name: self._stored(index, name, weights, scale_names) for name, _ in self.boxes}
        self.values = {(name, box): torch.empty(box_shape(box), dtype=self.stored[name][1]) for name, box in self.boxes}
        self._held = {}
        for (name, box), values in self.values.items():
            self._held.setdefault(name, []).append((box, values))
        wanted = {f"{name}#{k}": (name, box, index.dtype(name))
                  for k, (name, box) in enumerate(self.boxes) if (name, box) not in scale_boxes}
        exprs, plans, items = plan_boxes(index, wanted)
        items = [part for item in items for part in cut_item(item, limit_of(item))]
        groups = schedule(items)
        items = [item for group in groups for item in group.items]
        quantized = {t: scales[name, box] for t, (name, box, _) in wanted.items() if (name, box) in scales}
        wires = {position: self._wire(index, exprs, item, wanted[item.target][0])
                 for position, item in enumerate(items) if item.target in quantized}
        dests = {t: ChannelDest(self.values[name, box], self.values[quantized[t]]) if t in quantized
                 else TensorDest(self.values[name, box]) for t, (name, box, _) in wanted.items()}
        dests = with_whole(dests, plans, exprs, items, index.shape_of)
        return items, dests, byte_budget(groups, max_host_bytes), wires

    def _scale_boxes(self) -> dict[tuple[str, Box], tuple[str, Box]]:
        """Each quantized weight's box -> the box of its scales (`quantized`): the scale box
        asked for of the same rows; a scale box without its weight's is an ArgumentError."""
        if self.quantized is None:
            return {}
        scales = [(name, box) for name, box in self.boxes if name.endswith(".weight" + SCALE_SUFFIX)]
        of_rows = {(name[:-len(SCALE_SUFFIX)], box[:-1]): (name, box) for name, box in scales}
        pairs = {(name, box): of_rows[name, box[:-1]] for name, box in self.boxes if (name, box[:-1]) in of_rows}
        for name, box in scales:
            if box[-1] != (0, 1) or (name, box) not in pairs.values():
                raise ArgumentError(f"WeightSync: the target asks for box {list(box)} of the scales {name!r}, but not "
                                    f"for the same rows of {name[:-len(SCALE_SUFFIX)]!r} with them (a per-channel "
                                    "scale, one per row, is received with its weight's rows).")
        return pairs

    def _stored(self, index: CheckpointIndex, name: str, weights: set[str],
                scales: set[str]) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of tensor `name` as the engine stores it: the sources', or the 8-bit
        data and float32 [rows, 1] scales of a quantized weight (`weights`, `scales`)."""
        if name in weights:
            return tuple(index.shape(name)), self.quantized
        if name in scales:
            return tuple(index.shape(name[:-len(SCALE_SUFFIX)])[:-1]) + (1,), torch.float32
        return tuple(index.shape(name)), index.dtype(name)

    def _wire(self, index: CheckpointIndex, exprs: dict, item: ReadItem, name: str) -> ChannelWire:
        """How an item of quantized weight `name` travels: quantized by its source from whole
        rows of the 2-D weight, which that source's piece must hold, read as it lies (no
        conversion)."""
        cols = index.shape(name)[-1]
        if len(item.src_box) != 2 or item.ops or item.scales is not None or isinstance(exprs[item.target], Whole) \
                or item.entry.shape[-1] != cols:
            raise ArgumentError(f"WeightSync: {name!r} is stored quantized per channel, a scale per row over its "
                                f"{cols} columns, but its source piece {item.entry.key} holds "
                                f"{list(item.entry.shape)} of it (or is converted): each source rank must hold whole "
                                "rows of a weight the engine stores quantized (shard the trainer's rows, as FSDP does, "
                                "not its columns).")
        return ChannelWire(self.quantized, cols)

    def received(self, name: str, box: Box) -> torch.Tensor:
        """The values of `box` of tensor `name`, from the box asked for that holds it."""
        for held, values in self._held.get(name, ()):
            if all(a <= c and d <= b for (a, b), (c, d) in zip(held, box)):
                return values[tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(held, box))]
        raise ArgumentError(f"WeightSync: {name!r} box {list(box)} was not asked for at construction (asked: "
                            f"{[list(b) for b, _ in self._held.get(name, ())][:4]}); construct the sync with the "
                            "boxes the engine copies.")


def _check_box(index: CheckpointIndex, names: set[str], name: str, box: Box) -> None:
    if name not in names:
        raise ArgumentError(f"WeightSync: the target asks for {name!r}, which no source rank holds; the trainer "
                            "must hold every tensor the server loads, in the checkpoint's names.")
    shape = tuple(index.shape(name))
    if not box_within(box, shape):
        raise ArgumentError(f"WeightSync: the target asks for box {list(box)} of {name!r}, whose source shape is "
                            f"{list(shape)}; the trainer's model and the server's differ.")


class ChannelDest(NamedTuple):
    """Where a quantized weight's box lands (`wire.ChannelWire.place`): its 8-bit data and the
    scales of its rows."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.data.device
