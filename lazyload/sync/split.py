"""Read items larger than a sync's step budget, cut along the outermost dim of their source
box into items of at most the budget. Each part lands where those rows of the whole item
would: its destination box is cut alike, in the dim the item's ops move that dim to. A
quantized target is cut on whole scale groups and blocks only, so that each part quantizes
exactly as the whole item would."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..errors import PlanError
from ..expr import Whole
from ..plan import ReadItem
from ..planner import LoadPlan
from ..quant.onload import Grid
from ..schedule import Group


def split_plan(plan: LoadPlan, limit_of: Callable[[ReadItem], int | None]) -> LoadPlan:
    """`plan` with every item larger than `limit_of(item)` bytes (None: no limit) cut
    into parts of at most that many (`cut_item`), in its place in each item list."""
    def split(items) -> tuple[ReadItem, ...]:
        return tuple(part for item in items for part in cut_item(item, limit_of(item), grid_of(item.target)))

    def grid_of(target: str):  # a conversion's sources land in full precision, quantized once whole
        return None if isinstance(plan.mapping.exprs.get(target), Whole) else plan.quantized.get(target)

    if not any((limit := limit_of(item)) is not None and item.nbytes > limit for item in plan.items):
        return plan
    return replace(plan, items=list(split(plan.items)), groups=[Group(g.layer, split(g.items)) for g in plan.groups],
                   copy_groups=[Group(g.layer, split(g.items)) for g in plan.copy_groups])


def cut_item(item: ReadItem, limit: int | None, grid: Grid | None = None) -> tuple[ReadItem, ...]:
    """`item` in parts of at most `limit` bytes, cut along its source box's dim 0 in runs of
    whole grains (`_grain`; `grid`: its target's quantization); a PlanError when one grain
    is larger than `limit`."""
    if limit is None or item.nbytes <= limit:
        return (item,)
    dim = landing_dim(item.ops, len(item.src_box))
    rows = item.src_box[0][1] - item.src_box[0][0] if item.src_box else 1  # a 0-d item: one row
    grain = _grain(grid, dim, len(item.dst_box)) if item.src_box else 1
    row_bytes = item.nbytes // rows
    per = limit // row_bytes // grain * grain
    if not per:
        raise PlanError(f"WeightSync: {item.target} cannot be moved in parts of at most {limit} bytes (max_host_bytes "
                        f"of this rank or of the source rank holding {item.entry.key}): its smallest part, "
                        f"{grain} row(s) of its box {list(item.src_box)}, holds {grain * row_bytes} bytes"
                        + (f" ({grain} rows per scale group or block of its quantization)" if grain > 1 else "")
                        + f"; raise max_host_bytes to at least {grain * row_bytes}.")
    return tuple(_rows(item, dim, first, min(first + per, rows)) for first in range(0, rows, per))


def landing_dim(ops: tuple[tuple, ...], ndim: int) -> int:
    """The destination dim that a source box's dim 0 becomes through `ops` (`expr.apply_ops`)."""
    dim = 0
    for op in ops:
        if op[0] == "unsqueeze":
            ndim += 1
            dim += dim >= op[1] % ndim
        else:
            a, b = op[1] % ndim, op[2] % ndim
            dim = b if dim == a else a if dim == b else dim
    return dim


def _rows(item: ReadItem, dim: int, first: int, stop: int) -> ReadItem:
    """The part of `item` of rows [first, stop) of its source box's dim 0 (relative to it)."""
    src, dst = item.src_box[0][0], item.dst_box[dim][0]
    return replace(item, src_box=((src + first, src + stop),) + item.src_box[1:],
                   dst_box=item.dst_box[:dim] + ((dst + first, dst + stop),) + item.dst_box[dim + 1:])


def _grain(grid: Grid | None, dim: int, ndim: int) -> int:
    """The rows a cut of `dim` of an item's destination (of `ndim` dims) must keep together: a
    scale group of a quantized target's input dim, a block's rows of its row dim (FP8
    blocks), else one. The item's box starts on a group and a block already (the plan
    checks it), and ends on one or at the tensor's end."""
    if grid is None:
        return 1
    if dim == grid.axis % ndim:
        return grid.group
    return grid.rows if grid.rows > 1 and dim == ndim - 2 else 1
