"""Logical tensors: a tensor stored in pieces (one per source tensor-parallel rank, or per
head block of a fused QKV) as one expression over those pieces.

Each `Part` is an expression over stored keys (a whole stored tensor, or a chunk of one)
and the box of the logical tensor it holds. A `Layout` tiles the logical tensor with its
parts: nested `Cat`s along the dims where the boxes partition it, so that a rank's box
pushed down reads only the parts it overlaps. Parts with the same box are copies (a
replicated tensor in every rank's file); which copy is read is chosen per target rank, so
that at the world a checkpoint was sharded for each rank reads its own file (a weight sync
chooses again, by the sources each target rank receives from: `sync/copies.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..expr import Box, Cat, Expr, Transpose, box_shape, full_box


@dataclass(frozen=True, slots=True)  # one per stored piece, no __dict__ each
class Part:
    expr: Expr       # over stored keys; its shape is the box's
    box: Box         # where it lies in the logical tensor
    rank: int = 0    # the source rank whose file holds it


@dataclass(frozen=True)
class Layout:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Part, ...]
    world: int = 1   # source ranks the parts are spread over
    transpose: bool = False  # the parts tile the 2-D transpose of `shape` (Megatron's [out, in] as Conv1D's)

    def keys(self) -> list[str]:
        return list(dict.fromkeys(k for part in self.parts for k in part.expr.keys()))

    def expr(self, rank: int = 0, world: int = 1) -> Expr:
        """The tiling, each box's copy taken from the source rank nearest to the one that
        target rank `rank` of `world` corresponds to."""
        prefer = rank * self.world // max(world, 1)
        chosen: dict[Box, Part] = {}
        for part in self.parts:
            best = chosen.get(part.box)
            if best is None or abs(part.rank - prefer) < abs(best.rank - prefer):
                chosen[part.box] = part
        tiled = _tile(self.name, full_box(self.shape[::-1] if self.transpose else self.shape), list(chosen.values()))
        return Transpose(tiled) if self.transpose else tiled


def _tile(name: str, region: Box, parts: list[Part]) -> Expr:
    """The expression of `region` from parts whose boxes tile it exactly."""
    if len(parts) == 1 and parts[0].box == region:
        return parts[0].expr
    for dim, (lo, hi) in enumerate(region):
        by_span: dict[tuple[int, int], list[Part]] = {}
        for part in parts:  # grouped in one pass: a tensor may have tens of thousands of pieces
            by_span.setdefault(part.box[dim], []).append(part)
        spans = sorted(by_span)
        if len(spans) < 2 or spans[0][0] != lo or spans[-1][1] != hi:
            continue
        if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            continue  # gaps or overlaps along this dim: not the dim the pieces were cut on
        children = [_tile(name, region[:dim] + (span,) + region[dim + 1:], by_span[span]) for span in spans]
        return Cat(tuple(children), dim)
    boxes = sorted(part.box for part in parts)
    raise CheckpointError(f"logical tensor {name!r}: its pieces {boxes[:6]}{' ...' if len(boxes) > 6 else ''} do "
                          f"not tile the box {list(region)} (gaps or overlaps); the checkpoint description and its "
                          "files disagree.")


def check_part_shapes(name: str, parts: list[Part], shape_of) -> None:
    """Each part's expression has its box's shape (else the description lies about a file)."""
    for part in parts:
        got = part.expr.shape(shape_of)
        if got != box_shape(part.box):
            raise CheckpointError(f"logical tensor {name!r}: piece {part.expr} has shape {list(got)}, but the "
                                  f"checkpoint description places it in the box {list(part.box)}; the description "
                                  "and its files disagree.")
