"""Plan: which box of each target this rank owns, pushed down to the minimal read items.

A placement says how a target is split across `world` ranks: replicated, sharded on a dim,
or packed (a fused tensor whose `parts` equal components are each sharded on the dim, the
rank's pieces laid side by side). The rank's local tensor is made of one or more regions of
the full target; each region pushed through the target's expression gives the read items.
Every check that can fail (rank range, divisibility) fails here, before any byte is read.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Mapping as MappingT

import torch

from .errors import PlanError
from .expr import Box, Expr, ScaleRef, Whole, box_numel, full_box
from .gcpause import no_cycle_collection
from .headers import TensorEntry
from .index import CheckpointIndex


KINDS = ("replicate", "shard", "packed", "box")


@dataclass(frozen=True)
class Placement:
    """How one tensor is split over the `world` ranks of a tensor-parallel load.

    - `kind`: "replicate" (every rank holds the whole tensor), "shard" (rank r holds the
      r-th of `world` equal slices along `dim`), "packed" (a fused tensor of `parts` equal
      components along `dim`, e.g. q/k/v; each component is sharded and the rank's slices
      are laid side by side) or "box" (an explicit share given by `spans`; what a DTensor's
      placements resolve to, for one rank).
    - `dim`: the dimension split by "shard" and "packed" (negative counts from the end).
    - `parts`: "packed" only: the number of equal components along `dim` (>= 1).
    - `groups`: "shard"/"packed": shard over only `groups` ranks' worth of slices, each
      group of `world // groups` consecutive ranks holding the same slice (KV heads when
      world > number of KV heads); 0 (default): `world` slices.
    - `spans`: "box" only: per dim, the global (start, stop) index runs this rank holds, in
      local order (one tuple of runs per dim; () for a 0-d tensor). Resolved for one rank
      already, so rank and world do not apply.

    A field that does not fit the kind, or a kind not listed, is a PlanError here."""

    kind: str = "replicate"
    dim: int = 0
    parts: int = 1
    groups: int = 0
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"Placement kind {self.kind!r} is not one of {', '.join(map(repr, KINDS))}; e.g. "
                            "Placement('shard', dim=0) for rows, Placement('shard', dim=1) for columns.")
        for field, value, low in (("dim", self.dim, None), ("parts", self.parts, 1), ("groups", self.groups, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
                raise PlanError(f"Placement {field} must be an integer" + (f" >= {low}" if low is not None else "")
                                + f", got {value!r}.")
        if self.parts != 1 and self.kind != "packed":
            raise PlanError(f"Placement parts={self.parts} applies only to kind 'packed', not {self.kind!r}.")
        if self.groups and self.kind not in ("shard", "packed"):
            raise PlanError(f"Placement groups={self.groups} applies only to kinds 'shard' and 'packed'.")
        if self.spans and self.kind != "box":
            raise PlanError(f"Placement spans apply only to kind 'box', not {self.kind!r}.")


REPLICATE = Placement()


@dataclass(frozen=True)
class Region:
    """The part `global_box` of the full target lands at `local_start` of the local tensor."""

    global_box: Box
    local_start: tuple[int, ...]


@dataclass(frozen=True)
class TargetPlan:
    name: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    regions: tuple[Region, ...]


# Parts of a dequantized item (weight, scales, zero points) are staged from offsets that
# are multiples of this, so that each can be viewed as its own dtype.
STAGE_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // STAGE_ALIGN) * STAGE_ALIGN


@dataclass(frozen=True, slots=True)  # 45k+ a plan: no __dict__ each
class ScaleRead:
    """The scale blocks (and zero points) that cover a dequantized item's source box: `box`
    of `scale` (and of `zero`); `block[d]` weight elements per scale entry along dim d. A
    4-bit packed weight also reads its global scale `glob` whole (replicated: every rank,
    every box) and says how its bytes decode (`codec`, `quant.packed4`)."""

    scale: TensorEntry
    box: Box
    zero: TensorEntry | None
    block: tuple[int, ...]
    glob: TensorEntry | None = None
    codec: str | None = None


@dataclass(frozen=True, slots=True)  # 45k+ a plan: no __dict__ each
class ReadItem:
    """Read `src_box` of the checkpoint tensor `entry`, dequantize it with `scales` if any,
    apply `ops`, write to `dst_box` of the local tensor of `target`."""

    entry: TensorEntry
    src_box: Box
    ops: tuple[tuple, ...]
    target: str
    dst_box: Box
    scales: ScaleRead | None = None

    @property
    def nbytes(self) -> int:
        """Bytes read and held for this item until it is placed: its source box, and for a
        dequantized item also its scale blocks (each part from an aligned offset)."""
        weight = box_numel(self.src_box) * self.entry.itemsize
        if self.scales is None:
            return weight
        s = self.scales  # the parts of reads(), without building them (asked for 100k items at a time)
        scale = box_numel(s.box)
        return (_aligned(weight) + _aligned(scale * s.scale.itemsize)
                + (_aligned(scale * s.zero.itemsize) if s.zero is not None else 0)
                + (_aligned(s.glob.end - s.glob.start) if s.glob is not None else 0))

    def reads(self) -> tuple[ReadItem, ...]:
        """The single-tensor reads this item needs: itself, or for a dequantized item its
        weight box, scale blocks, zero points and global scale (in that order)."""
        if self.scales is None:
            return (self,)
        s = self.scales
        glob = full_box(s.glob.shape) if s.glob is not None else ()
        return ((replace(self, scales=None), ReadItem(s.scale, s.box, (), self.target, s.box))
                + ((ReadItem(s.zero, s.box, (), self.target, s.box),) if s.zero is not None else ())
                + ((ReadItem(s.glob, glob, (), self.target, glob),) if s.glob is not None else ()))

    def staging(self, buffer: torch.Tensor) -> list[tuple[ReadItem, torch.Tensor]]:
        """Each of `reads()` with its range of a staging buffer of `nbytes` bytes."""
        if self.scales is None:
            return [(self, buffer)]
        out, offset = [], 0
        for part in self.reads():
            out.append((part, buffer[offset:offset + part.nbytes]))
            offset += _aligned(part.nbytes)
        return out


def check_rank(rank: int, world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise PlanError(f"world must be an integer >= 1, got {world!r}.")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise PlanError(f"rank must be an integer in [0, {world}), got {rank!r}.")


def shard_span(name: str, size: int, rank: int, world: int, what: str = "dim") -> tuple[int, int]:
    if size % world:
        raise PlanError(f"{name}: {what} of size {size} does not split evenly over {world} ranks; "
                        f"choose a world that divides it, or replicate this tensor: plan={{{name!r}: 'replicate'}}.")
    step = size // world
    return rank * step, (rank + 1) * step


def local_regions(name: str, shape: tuple[int, ...], placement: Placement, rank: int,
                  world: int) -> tuple[tuple[int, ...], tuple[Region, ...]]:
    """The local shape and the regions of the full target this rank holds."""
    if placement.kind == "box":
        return box_regions(name, shape, placement.spans)
    if placement.kind == "replicate" or world == 1:
        return shape, (Region(full_box(shape), (0,) * len(shape)),)
    dim = placement.dim
    if not -len(shape) <= dim < len(shape):
        raise PlanError(f"{name}: cannot shard dim {dim} of a tensor of shape {list(shape)}.")
    dim %= len(shape)
    shards, shard = world, rank
    if placement.groups and placement.groups < world:
        if world % placement.groups:
            raise PlanError(f"{name}: {placement.groups} groups (e.g. KV heads) cannot be spread over "
                            f"{world} ranks; use a world that is a multiple or a divisor of it.")
        shards, shard = placement.groups, rank // (world // placement.groups)
    parts = placement.parts if placement.kind == "packed" else 1
    if shape[dim] % parts:
        raise PlanError(f"{name}: dim {dim} of size {shape[dim]} is not {parts} equal packed components.")
    part_size = shape[dim] // parts
    start, stop = shard_span(name, part_size, shard, shards)
    regions = []
    for p in range(parts):
        box = full_box(shape)
        box = box[:dim] + ((p * part_size + start, p * part_size + stop),) + box[dim + 1:]
        local_start = tuple(p * (stop - start) if d == dim else 0 for d in range(len(shape)))
        regions.append(Region(box, local_start))
    local_shape = shape[:dim] + (parts * (stop - start),) + shape[dim + 1:]
    return local_shape, tuple(regions)


def box_regions(name: str, shape: tuple[int, ...],
                spans: tuple[tuple[tuple[int, int], ...], ...]) -> tuple[tuple[int, ...], tuple[Region, ...]]:
    """Regions of an explicit share: the product over dims of each dim's runs."""
    if len(spans) != len(shape):
        raise PlanError(f"{name}: an explicit box needs one list of spans per dim of {list(shape)}, got {spans!r}.")
    for d, runs in enumerate(spans):
        for start, stop in runs:
            if not 0 <= start <= stop <= shape[d]:
                raise PlanError(f"{name}: span {start}:{stop} lies outside dim {d} of size {shape[d]}.")
    local_shape = tuple(sum(b - a for a, b in runs) for runs in spans)
    per_dim = []
    for runs in spans:
        offset, entries = 0, []
        for start, stop in runs:
            entries.append(((start, stop), offset))
            offset += stop - start
        per_dim.append(entries)
    regions = [Region(tuple(e[0] for e in combo), tuple(e[1] for e in combo))
               for combo in itertools.product(*per_dim)]
    return local_shape, tuple(r for r in regions if box_numel(r.global_box))


def _scale_read(ref: ScaleRef | None, entries: MappingT[str, TensorEntry]) -> ScaleRead | None:
    if ref is None:
        return None
    zero = entries[ref.zero] if ref.zero is not None else None
    glob = entries[ref.glob] if ref.glob is not None else None
    return ScaleRead(entries[ref.key], ref.box, zero, ref.block, glob, ref.codec)


def plan_for_rank(exprs: MappingT[str, Expr], index: CheckpointIndex, shapes: MappingT[str, tuple[int, ...]],
                  dtypes: MappingT[str, torch.dtype], placements: MappingT[str, Placement], rank: int = 0,
                  world: int = 1) -> tuple[list[TargetPlan], list[ReadItem]]:
    """This rank's local tensors and the read items that fill them."""
    check_rank(rank, world)
    with no_cycle_collection():
        return _plan(exprs, index, shapes, dtypes, placements, rank, world)


def plan_boxes(index: CheckpointIndex, wanted: MappingT[str, tuple[str, Box, torch.dtype]]
               ) -> tuple[dict[str, Expr], list[TargetPlan], list[ReadItem]]:
    """The read items of boxes another engine asks for: `wanted` maps a target name to (the
    index's tensor, a box of it, the dtype it lands in); each target is that box alone."""
    exprs = {t: index.expr(name) for t, (name, _, _) in wanted.items()}
    plans, items = plan_for_rank(exprs, index, {t: tuple(index.shape(name)) for t, (name, _, _) in wanted.items()},
                                 {t: dtype for t, (_, _, dtype) in wanted.items()},
                                 {t: Placement("box", spans=tuple(((a, b),) for a, b in box))
                                  for t, (_, box, _) in wanted.items()})
    return exprs, plans, items


def _plan(exprs: MappingT[str, Expr], index: CheckpointIndex, shapes: MappingT[str, tuple[int, ...]],
          dtypes: MappingT[str, torch.dtype], placements: MappingT[str, Placement], rank: int,
          world: int) -> tuple[list[TargetPlan], list[ReadItem]]:
    shape_of, entries = index.shape_of, index.by_key()
    targets, items = [], []
    for name, expr in exprs.items():
        placement = placements.get(name, REPLICATE)
        local_shape, regions = local_regions(name, shapes[name], placement, rank, world)
        targets.append(TargetPlan(name, shapes[name], local_shape, dtypes[name], placement, regions))
        if isinstance(expr, Whole):  # its sources read whole, in their own coordinates (placer.WholeDest)
            items += [ReadItem(entries[p.key], p.src_box, p.ops, name, p.dst_box, _scale_read(p.scales, entries))
                      for p in expr.pieces(full_box(shapes[name]), shape_of)]
            continue
        for region in regions:
            shift = tuple(local - start for (start, _), local in zip(region.global_box, region.local_start))
            moved = any(shift)  # else the pieces land where the full target has them
            for piece in expr.pieces(region.global_box, shape_of):
                dst = tuple((a + d, b + d) for (a, b), d in zip(piece.dst_box, shift)) if moved else piece.dst_box
                items.append(ReadItem(entries[piece.key], piece.src_box, piece.ops, name, dst,
                                      _scale_read(piece.scales, entries)))
    return targets, items
