"""The sources of a sync as a checkpoint index: every source rank's box of a tensor is a
stored entry (`file` "rank R", key "name@R.i"), and each tensor a logical tensor tiled by
those boxes (`formats/logical.py`); a Megatron-Core source's tensors are then named as
transformers' by the torch_dist reader's mapping (`megatron_source.py`). Boxes held by
several ranks (a tensor FSDP or TP leaves replicated) are copies: the planner takes one by
position, as for a checkpoint's files, and `copies.py` chooses again which one each target
rank receives."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ArgumentError
from ..expr import Source, box_shape
from ..formats.logical import Layout, Part
from ..formats.megatron_dist import layer_key, transformers_names
from ..headers import TensorEntry
from ..index import CheckpointIndex
from .layout import Held, SourceTensor


_MEGATRON = "the sync's Megatron-Core source"


@dataclass(frozen=True)
class Piece:
    """What a stored key of the sync index is: `held` box of tensor `name` on source rank `rank`."""

    rank: int
    name: str
    held: Held


def rank_file(rank: int) -> str:
    return f"rank {rank}"


def source_index(layouts: dict[int, list[SourceTensor]], tiled: bool = True) -> tuple[CheckpointIndex, dict[str, Piece]]:
    """The index of every source rank's boxes (`layouts`: global rank -> its tensors), and
    stored key -> the piece it names. `tiled=False`: the stored keys alone, no logical
    tensors (a source rank's own boxes, which need not tile a tensor)."""
    ranks = sorted(layouts)
    entries, pieces, parts, meta = [], {}, {}, {}
    for position, rank in enumerate(ranks):
        offset = 0
        for tensor in layouts[rank]:
            _check_same(meta.setdefault(tensor.name, tensor), tensor, rank)
            for i, held in enumerate(tensor.held):
                key, shape = f"{tensor.name}@{rank}.{i}", box_shape(held.box)
                nbytes = math.prod(shape) * tensor.torch_dtype.itemsize
                entries.append((key, TensorEntry(rank_file(rank), key, tensor.torch_dtype, shape, offset,
                                                 offset + nbytes)))
                offset += nbytes
                pieces[key] = Piece(rank, tensor.name, held)
                parts.setdefault(tensor.name, []).append(Part(Source(key), held.box, position))
    layouts_of = {name: Layout(name, meta[name].shape, meta[name].torch_dtype, tuple(p), len(ranks))
                  for name, p in parts.items()}
    heads = next((t.megatron for t in meta.values() if t.megatron is not None), None)
    if heads is not None and tiled:  # a Megatron-Core source: its names read as the torch_dist reader reads them
        layouts_of = transformers_names({layer_key(n, _MEGATRON): layout for n, layout in layouts_of.items()}, heads,
                                        _MEGATRON)
    return CheckpointIndex.of([rank_file(r) for r in ranks], entries, layouts_of if tiled else None,
                              description="the sync's source ranks"), pieces


def _check_same(first: SourceTensor, other: SourceTensor, rank: int) -> None:
    if (first.shape, first.dtype) != (other.shape, other.dtype):
        raise ArgumentError(f"WeightSync: source tensor {first.name!r} is {other.dtype} {list(other.shape)} on rank "
                            f"{rank} but {first.dtype} {list(first.shape)} on another source rank; every source rank "
                            "must hold the same model.")
