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
from ..expr import Box, Source, box_shape
from ..formats.logical import Layout, Part
from ..formats.megatron_dist import layer_key, transformers_names
from ..headers import TensorEntry
from ..index import CheckpointIndex
from .layout import Held, RuledTensor, SourceTensor


_MEGATRON = "the sync's Megatron-Core source"


@dataclass(frozen=True)
class Unread:
    """A stored key of a target's sync index standing for boxes of a ruled tensor it does
    not read (`indexed`): the tensor and the box."""

    name: str
    box: Box


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
    index, pieces, _ = indexed(layouts, tiled)
    return index, pieces


def indexed(layouts: dict[int, list[SourceTensor]], tiled: bool = True, rules: dict[str, RuledTensor] | None = None,
            ranks: list[int] | None = None, wanted: dict[str, list[Box]] | None = None, own: int | None = None
            ) -> tuple[CheckpointIndex, dict[str, Piece], dict[str, Unread]]:
    """`source_index`, with tensors described by strided rules (`rules`: name -> the tensor as
    every rank holding it holds it) beside the ranks' own boxes; `ranks`: every source rank
    (default: those of `layouts`). `wanted`: name -> the boxes of it a target reads; a ruled
    tensor's boxes overlapping none are not expanded, each run of them one stored key
    standing for them all (`Unread`, returned apart), so that the index grows with the
    boxes a target reads, not with the source ranks. None: every box. `own`: a source rank
    whose boxes are expanded all the same (a target that is a source too sends them)."""
    ranks = sorted(layouts) if ranks is None else list(ranks)
    position = {rank: i for i, rank in enumerate(ranks)}
    entries, pieces, parts, meta, unread, dtypes = [], {}, {}, {}, {}, {}

    def add(key: str, rank: int, name: str, box: Box, offset: int = 0) -> int:
        if name not in dtypes:  # asked once per tensor: a target's index may hold thousands of its boxes
            dtypes[name] = meta[name].torch_dtype
        shape = box_shape(box)
        nbytes = math.prod(shape) * dtypes[name].itemsize
        entries.append((key, TensorEntry(rank_file(rank), key, dtypes[name], shape, offset, offset + nbytes)))
        parts.setdefault(name, []).append(Part(Source(key), box, position[rank]))
        return offset + nbytes

    for rank in sorted(layouts):
        offset = 0
        for tensor in layouts[rank]:
            _check_same(meta.setdefault(tensor.name, tensor), tensor, rank)
            for i, held in enumerate(tensor.held):
                key = f"{tensor.name}@{rank}.{i}"
                offset = add(key, rank, tensor.name, held.box, offset)
                pieces[key] = Piece(rank, tensor.name, held)
    for k, (name, tensor) in enumerate((rules or {}).items()):
        at = k << 40  # where the tensor's box lies in its rank's "file": in the order the rank's own has it
        for rule in tensor.rules:
            _check_same(meta.setdefault(name, tensor), tensor, rule.first)
            lo, hi = rule.base[rule.dim]
            last = min(rule.count, -(-(hi - lo) // rule.step))  # the steps holding a box
            chosen = range(last) if wanted is None else sorted(i for i in rule.overlapping(wanted.get(name, [])) | (
                {(own - rule.first) // rule.stride} if own is not None and rule.holds(own) else set()) if i < last)
            start = 0
            for i in [*chosen, last]:
                if start < i:  # steps start..i-1 not read: one key for them
                    box = rule.base[:rule.dim] + ((rule.box(start)[rule.dim][0], rule.box(i - 1)[rule.dim][1]),) + \
                        rule.base[rule.dim + 1:]
                    key = f"{name}@unread.{len(unread)}"
                    add(key, rule.rank(start), name, box, at)
                    unread[key] = Unread(name, box)
                if i < last:
                    key, box = f"{name}@{rule.rank(i)}.0", rule.box(i)
                    add(key, rule.rank(i), name, box, at)
                    pieces[key] = Piece(rule.rank(i), name, Held(box, (0,) * len(box)))
                start = i + 1
    for name in rules or {}:  # by source rank, as the ranks' own boxes are (which copy a plan prefers)
        parts[name].sort(key=lambda part: part.rank)
    layouts_of = {name: Layout(name, meta[name].shape, meta[name].torch_dtype, tuple(p), len(ranks))
                  for name, p in parts.items()}
    heads = next((t.megatron for t in meta.values() if getattr(t, "megatron", None) is not None), None)
    if heads is not None and tiled:  # a Megatron-Core source: its names read as the torch_dist reader reads them
        layouts_of = transformers_names({layer_key(n, _MEGATRON): layout for n, layout in layouts_of.items()}, heads,
                                        _MEGATRON)
    return CheckpointIndex.of([rank_file(r) for r in ranks], entries, layouts_of if tiled else None,
                              description="the sync's source ranks"), pieces, unread


def _check_same(first: SourceTensor, other: SourceTensor, rank: int) -> None:
    if (first.shape, first.dtype) != (other.shape, other.dtype):
        raise ArgumentError(f"WeightSync: source tensor {first.name!r} is {other.dtype} {list(other.shape)} on rank "
                            f"{rank} but {first.dtype} {list(first.shape)} on another source rank; every source rank "
                            "must hold the same model.")
