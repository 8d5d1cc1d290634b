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
from .layout import Held, RuledTensor, SourceTensor, Strided


_MEGATRON = "the sync's Megatron-Core source"


@dataclass(frozen=True)
class Unread:
    """A stored key of a target's sync index standing for boxes of a ruled tensor it does
    not read (`indexed`): the tensor and the box."""

    name: str
    box: Box


@dataclass(frozen=True, slots=True)  # one per source box a target indexes
class Piece:
    """What a stored key of the sync index is: `held` box of tensor `name` on source rank `rank`."""

    rank: int
    name: str
    held: Held


def rank_file(rank: int) -> str:
    return f"rank {rank}"


def copies_of(pieces: dict[str, Piece]) -> dict[str, tuple[str, dict[int, str]]]:
    """Stored key of a replicated box -> the box's name (its copies' least key) and its copies'
    keys by source rank (itself included): the pieces of a tensor with the same box at the
    same place of their rank's local tensor (so that a request's box, relative to the piece,
    reads the same values from any of them). Keys held by one rank alone are left out."""
    by_box: dict[tuple, dict[int, str]] = {}
    for key, piece in pieces.items():
        by_box.setdefault((piece.name, piece.held), {})[piece.rank] = key
    return {key: (min(held.values()), held) for held in by_box.values() if len(held) > 1 for key in held.values()}


def source_index(layouts: dict[int, list[SourceTensor]], tiled: bool = True) -> tuple[CheckpointIndex, dict[str, Piece]]:
    """The index of every source rank's boxes (`layouts`: global rank -> its tensors), and
    stored key -> the piece it names. `tiled=False`: the stored keys alone, no logical
    tensors (a source rank's own boxes, which need not tile a tensor)."""
    index, pieces, _, _ = indexed(layouts, tiled)
    return index, pieces


def indexed(layouts: dict[int, list[SourceTensor]], tiled: bool = True, rules: dict[str, RuledTensor] | None = None,
            ranks: list[int] | None = None, wanted: dict[str, list[Box]] | None = None, own: int | None = None,
            prefer: int | None = None) -> tuple[CheckpointIndex, dict[str, Piece], dict[str, Unread], dict]:
    """`source_index`, with tensors described by strided rules (`rules`: name -> the tensor as
    every rank holding it holds it) beside the ranks' own boxes; `ranks`: every source rank
    (default: those of `layouts`). `wanted`: name -> the boxes of it a target reads; a ruled
    tensor's boxes overlapping none are not expanded, each run of them one stored key
    standing for them all (`Unread`, returned apart), so that the index grows with the
    boxes a target reads, not with the source ranks. None: every box. `own`: a source rank
    whose boxes are expanded all the same (a target that is a source too sends them).
    `prefer`: the source position whose copies the target's plan takes (`Layout.expr`): of a
    box several rules hold alike only that copy is indexed (and `own`'s), the others
    returned as copies (`copies_of`'s form) for `copies.py` to choose from, with the copies
    among the ranks' own boxes."""
    ranks = sorted(layouts) if ranks is None else list(ranks)
    built = _Built(ranks)
    for rank in sorted(layouts):
        built.boxes_of(rank, layouts[rank])
    for k, tensor in enumerate((rules or {}).values()):
        built.ruled(tensor, k << 40, None if wanted is None else wanted.get(tensor.name, []), own,
                    None if wanted is None else prefer)
    layouts_of = {name: Layout(name, built.meta[name].shape, built.meta[name].torch_dtype,
                               tuple(sorted(p, key=lambda part: part.rank)), len(ranks))
                  for name, p in built.parts.items()}  # by source rank (which copy a plan prefers)
    heads = next((t.megatron for t in built.meta.values() if getattr(t, "megatron", None) is not None), None)
    if heads is not None and tiled:  # a Megatron-Core source: its names read as the torch_dist reader reads them
        layouts_of = transformers_names({layer_key(n, _MEGATRON): layout for n, layout in layouts_of.items()}, heads,
                                        _MEGATRON)
    return CheckpointIndex.of([rank_file(r) for r in ranks], built.entries, layouts_of if tiled else None,
                              description="the sync's source ranks"), built.pieces, built.unread, built.all_copies()


class _Built:
    """The entries, pieces and logical tensors' parts of a sync index as `indexed` adds them."""

    def __init__(self, ranks: list[int]):
        self.position = {rank: i for i, rank in enumerate(ranks)}
        self.entries: list = []
        self.pieces: dict[str, Piece] = {}
        self.parts: dict[str, list[Part]] = {}
        self.meta: dict = {}
        self.unread: dict[str, Unread] = {}
        self.copies: dict[str, tuple[str, dict[int, str]]] = {}  # a ruled tensor's, as `ruled` finds them
        self.searched: set[str] = set()  # tensors whose copies `copies_of` finds: a rank's own boxes, or several rules'
        self._dtypes: dict = {}  # asked once per tensor: a target's index may hold thousands of its boxes

    def add(self, key: str, rank: int, name: str, box: Box, offset: int = 0) -> int:
        if name not in self._dtypes:
            self._dtypes[name] = self.meta[name].torch_dtype
        shape = box_shape(box)
        nbytes = math.prod(shape) * self._dtypes[name].itemsize
        self.entries.append((key, TensorEntry(rank_file(rank), key, self._dtypes[name], shape, offset,
                                              offset + nbytes)))
        self.parts.setdefault(name, []).append(Part(Source(key), box, self.position[rank]))
        return offset + nbytes

    def boxes_of(self, rank: int, tensors: list[SourceTensor]) -> None:
        """A source rank's own boxes."""
        offset = 0
        for tensor in tensors:
            _check_same(self.meta.setdefault(tensor.name, tensor), tensor, rank)
            self.searched.add(tensor.name)
            for i, held in enumerate(tensor.held):
                key = f"{tensor.name}@{rank}.{i}"
                offset = self.add(key, rank, tensor.name, held.box, offset)
                self.pieces[key] = Piece(rank, tensor.name, held)

    def ruled(self, tensor: RuledTensor, at: int, wanted: list[Box] | None, own: int | None,
              prefer: int | None) -> None:
        """A ruled tensor's boxes (at offset `at` of each rank's "file": in the order its own
        has them), as `indexed` says."""
        alike: dict[tuple, list[Strided]] = {}  # rules of the same boxes (copies: a tensor FSDP leaves replicated)
        for rule in tensor.rules:
            _check_same(self.meta.setdefault(tensor.name, tensor), tensor, rule.first)
            alike.setdefault((rule.base, rule.dim, rule.step, rule.count), []).append(rule)
        if len(alike) > 1:  # boxes of rules of other steps may still coincide
            self.searched.add(tensor.name)
        for runs in alike.values():
            chosen = _chosen(runs, wanted, own)
            if len(runs) == 1:  # no copies (an expert FSDP alone shards): each box chosen is indexed
                self.rule(runs[0], tensor.name, chosen, at, None)
                continue
            for i in chosen:  # each copy's key, for `copies.py` (only the nearest is indexed)
                held = {run.rank(i): f"{tensor.name}@{run.rank(i)}.0" for run in runs}
                self.copies.update(dict.fromkeys(held.values(), (min(held.values()), held)))
            position = self.position
            nearest = {} if prefer is None else {
                i: min(runs, key=lambda run: (abs(position[run.rank(i)] - prefer), position[run.rank(i)]))
                for i in chosen}
            for rule in runs:
                self.rule(rule, tensor.name, chosen, at, lambda i: nearest.get(i, rule) is rule or rule.rank(i) == own)

    def rule(self, rule: Strided, name: str, chosen: list[int], at: int, indexes) -> None:
        """A rule's boxes at the steps `chosen` that `indexes(i)` (else a copy's is; None:
        all), each run of the others one `Unread` key."""
        start, last, at_start = 0, rule.steps(), (0,) * len(rule.base)
        for i in [*chosen, last]:
            if start < i:  # steps start..i-1 not read: one key for them
                box = rule.base[:rule.dim] + ((rule.box(start)[rule.dim][0], rule.box(i - 1)[rule.dim][1]),) + \
                    rule.base[rule.dim + 1:]
                key = f"{name}@unread.{len(self.unread)}"
                self.add(key, rule.rank(start), name, box, at)
                self.unread[key] = Unread(name, box)
            if i < last and (indexes is None or indexes(i)):
                rank, box = rule.rank(i), rule.box(i)
                key = f"{name}@{rank}.0"
                self.add(key, rank, name, box, at)
                self.pieces[key] = Piece(rank, name, Held(box, at_start))
            start = i + 1

    def all_copies(self) -> dict[str, tuple[str, dict[int, str]]]:
        """Every replicated box's copies (`copies_of`'s form): searched among the pieces only for
        the tensors whose rules do not give them (a target's index holds thousands of boxes of
        tensors that one rule each describes, none of them copies)."""
        searched = {key: piece for key, piece in self.pieces.items() if piece.name in self.searched}
        return {**copies_of(searched), **self.copies}


def _chosen(runs: list[Strided], wanted: list[Box] | None, own: int | None) -> list[int]:
    """The steps of rules of the same boxes (copies) to index: those overlapping `wanted`
    (None: all), and `own`'s."""
    last = runs[0].steps()
    if wanted is None:
        return list(range(last))
    steps = runs[0].overlapping(wanted) | {(own - run.first) // run.stride for run in runs
                                            if own is not None and run.holds(own)}
    return sorted(i for i in steps if i < last)


def _check_same(first: SourceTensor, other: SourceTensor, rank: int) -> None:
    if (first.shape, first.dtype) != (other.shape, other.dtype):
        raise ArgumentError(f"WeightSync: source tensor {first.name!r} is {other.dtype} {list(other.shape)} on rank "
                            f"{rank} but {first.dtype} {list(first.shape)} on another source rank; every source rank "
                            "must hold the same model.")
