"""A sync target given as the boxes it asks for rather than as a model: an inference engine
whose own weight loaders decide which box of each checkpoint tensor a worker holds (vLLM's
workers, `integrations.vllm_update`). Every box is received into a host tensor of its own,
allocated once and refilled by each sync; the engine then copies from those (`received`),
so a failed sync leaves the engine's weights as they were."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..errors import ArgumentError
from ..expr import Box, box_shape, box_within
from ..index import CheckpointIndex
from ..placer import TensorDest, with_whole
from ..plan import ReadItem, plan_boxes
from ..planner import byte_budget
from ..schedule import schedule
from .split import cut_item


class BoxTarget:
    """`WeightSync(target=BoxTarget(boxes))`: `boxes` are (tensor name, box) pairs, a box
    being per dim the (start, stop) of the tensor this rank receives, in the names the
    sources hold (a Hugging Face checkpoint's, for an HF trainer)."""

    def __init__(self, boxes: Iterable[tuple[str, Box]]):
        self.boxes = list(dict.fromkeys((name, tuple(tuple(span) for span in box)) for name, box in boxes))
        self.values: dict[tuple[str, Box], torch.Tensor] = {}
        self._held: dict[str, list[tuple[Box, torch.Tensor]]] = {}  # name -> its boxes' values: a lookup per copy

    def plan(self, index: CheckpointIndex, max_host_bytes: int | None,
             limit_of: Callable[[ReadItem], int | None] = lambda item: None) -> tuple[list, dict, int]:
        """(read items in layer order, their destinations, the byte budget) over the sources'
        index, each item larger than `limit_of(item)` bytes cut (`split.cut_item`); a box that
        no source holds is an ArgumentError naming it, before any byte moves."""
        names = set(index.names())
        for name, box in self.boxes:
            _check_box(index, names, name, box)
        wanted = {f"{name}#{k}": (name, box, index.dtype(name))
                  for k, (name, box) in enumerate(self.boxes)}
        exprs, plans, items = plan_boxes(index, wanted)
        items = [part for item in items for part in cut_item(item, limit_of(item))]
        groups = schedule(items)
        self.values = {(name, box): torch.empty(box_shape(box), dtype=dtype) for name, box, dtype in wanted.values()}
        self._held = {}
        for (name, box), values in self.values.items():
            self._held.setdefault(name, []).append((box, values))
        dests = {t: TensorDest(self.values[name, box]) for t, (name, box, _) in wanted.items()}
        dests = with_whole(dests, plans, exprs, items, index.shape_of)
        return [item for group in groups for item in group.items], dests, byte_budget(groups, max_host_bytes)

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
