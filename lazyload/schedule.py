"""Schedule: read items grouped by layer and ordered by file offset, under a byte budget."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .mapping import natural_key
from .plan import ReadItem

# A layer is the module prefix up to the first numbered block: "model.layers.17",
# "transformer.h.3", "encoder.layer.2", "blocks.0".
_LAYER = re.compile(r"^(.*?\.?(?:layers|layer|h|blocks|block)\.\d+)\.")


def layer_of(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else ""


@dataclass(frozen=True)
class Group:
    layer: str  # "" for tensors outside numbered layers (embeddings, final norm, head)
    items: tuple[ReadItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)


def _order(item: ReadItem) -> tuple:
    return item.entry.file, item.entry.start, item.src_box


def schedule(items: list[ReadItem]) -> list[Group]:
    """Groups by layer, each ordered by (file, offset); groups in file order, so that a
    checkpoint written layer by layer is read front to back."""
    by_layer: dict[str, list[ReadItem]] = {}
    layers: dict[str, list[ReadItem]] = {}  # target -> its layer's list: one regex per target, not per item
    for item in items:
        group = layers.get(item.target)
        if group is None:
            group = layers[item.target] = by_layer.setdefault(layer_of(item.target), [])
        group.append(item)
    groups = [Group(layer, tuple(sorted(its, key=_order))) for layer, its in by_layer.items()]
    groups.sort(key=lambda g: (_order(g.items[0])[:2], natural_key(g.layer)))
    return groups


def default_budget(groups: list[Group]) -> int:
    """About one layer of this rank's reads, never less than its largest single item."""
    layer = largest = 0
    for group in groups:  # each item's bytes once: a plan of 100k items asks this
        sizes = [item.nbytes for item in group.items]
        layer = max(layer, sum(sizes)) if group.layer else layer
        largest = max(largest, *sizes)
    return max(layer, largest)
