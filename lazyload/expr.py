"""Expressions: each model tensor as a small expression over checkpoint tensors.

A box (start, stop per dim) of the target pushed down through an expression gives the
minimal pieces to read: (checkpoint key, source box) -> (ops, destination box). Only
shape-level operations live here (stack, concatenate, chunk, transpose), so pushing a
box down is exact and no byte outside a rank's share is ever needed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

Box = tuple[tuple[int, int], ...]
ShapeOf = Callable[[str], tuple[int, ...]]  # checkpoint key -> shape


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def _replace(box: Box, dim: int, span: tuple[int, int]) -> Box:
    return box[:dim] + (span,) + box[dim + 1:]


def _shift(box: Box, dim: int, offset: int) -> Box:
    start, stop = box[dim]
    return _replace(box, dim, (start + offset, stop + offset))


def _swap(seq: tuple, a: int, b: int) -> tuple:
    out = list(seq)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


@dataclass(frozen=True)
class Piece:
    """Read `src_box` of checkpoint tensor `key`, apply `ops` in order
    (("unsqueeze", d) or ("transpose", a, b)), and write the result to `dst_box`."""

    key: str
    src_box: Box
    ops: tuple[tuple, ...]
    dst_box: Box


class Expr:
    def shape(self, shape_of: ShapeOf) -> tuple[int, ...]:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def pieces(self, box: Box, shape_of: ShapeOf) -> list[Piece]:
        raise NotImplementedError


@dataclass(frozen=True)
class Source(Expr):
    key: str

    def shape(self, shape_of):
        return tuple(shape_of(self.key))

    def keys(self):
        return [self.key]

    def pieces(self, box, shape_of):
        return [Piece(self.key, box, (), box)] if box_numel(box) else []

    def __str__(self):
        return self.key


@dataclass(frozen=True)
class Stack(Expr):
    """torch.stack(parts, dim): per-expert tensors into one 3D parameter."""

    parts: tuple[Expr, ...]
    dim: int = 0

    def shape(self, shape_of):
        shapes = {p.shape(shape_of) for p in self.parts}
        if len(shapes) != 1:
            raise ValueError(f"stack of tensors with different shapes {sorted(shapes)}")
        part = shapes.pop()
        return part[:self.dim] + (len(self.parts),) + part[self.dim:]

    def keys(self):
        return [k for p in self.parts for k in p.keys()]

    def pieces(self, box, shape_of):
        start, stop = box[self.dim]
        child_box = box[:self.dim] + box[self.dim + 1:]
        out = []
        for i in range(start, stop):
            for p in self.parts[i].pieces(child_box, shape_of):
                dst = p.dst_box[:self.dim] + ((i, i + 1),) + p.dst_box[self.dim:]
                out.append(Piece(p.key, p.src_box, p.ops + (("unsqueeze", self.dim),), dst))
        return out

    def __str__(self):
        return f"stack[{self.dim}]({self.parts[0]} .. {self.parts[-1]}, {len(self.parts)} tensors)"


@dataclass(frozen=True)
class Cat(Expr):
    """torch.cat(parts, dim): q/k/v or gate/up fused into one parameter."""

    parts: tuple[Expr, ...]
    dim: int = 0

    def shape(self, shape_of):
        shapes = [p.shape(shape_of) for p in self.parts]
        rest = {s[:self.dim] + s[self.dim + 1:] for s in shapes}
        if len(rest) != 1:
            raise ValueError(f"concatenation on dim {self.dim} of incompatible shapes {shapes}")
        first = shapes[0]
        return first[:self.dim] + (sum(s[self.dim] for s in shapes),) + first[self.dim + 1:]

    def keys(self):
        return [k for p in self.parts for k in p.keys()]

    def pieces(self, box, shape_of):
        start, stop = box[self.dim]
        out, offset = [], 0
        for part in self.parts:
            size = part.shape(shape_of)[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                child_box = _replace(box, self.dim, (lo - offset, hi - offset))
                for p in part.pieces(child_box, shape_of):
                    out.append(Piece(p.key, p.src_box, p.ops, _shift(p.dst_box, self.dim, offset)))
            offset += size
        return out

    def __str__(self):
        return f"cat[{self.dim}](" + ", ".join(str(p) for p in self.parts) + ")"


@dataclass(frozen=True)
class Chunk(Expr):
    """Chunk `index` of `count` equal chunks of `part` along `dim`: a fused source split
    into separate parameters."""

    part: Expr
    dim: int
    index: int
    count: int

    def shape(self, shape_of):
        shape = self.part.shape(shape_of)
        if shape[self.dim] % self.count:
            raise ValueError(f"dim {self.dim} of size {shape[self.dim]} does not split into {self.count} chunks")
        return _replace_dim(shape, self.dim, shape[self.dim] // self.count)

    def keys(self):
        return self.part.keys()

    def pieces(self, box, shape_of):
        offset = self.index * (self.part.shape(shape_of)[self.dim] // self.count)
        return [Piece(p.key, p.src_box, p.ops, _shift(p.dst_box, self.dim, -offset))
                for p in self.part.pieces(_shift(box, self.dim, offset), shape_of)]

    def __str__(self):
        return f"chunk[{self.dim}]({self.part}, {self.index}/{self.count})"


@dataclass(frozen=True)
class Transpose(Expr):
    part: Expr
    dim0: int = 0
    dim1: int = 1

    def shape(self, shape_of):
        return _swap(self.part.shape(shape_of), self.dim0, self.dim1)

    def keys(self):
        return self.part.keys()

    def pieces(self, box, shape_of):
        child_box = _swap(box, self.dim0, self.dim1)
        return [Piece(p.key, p.src_box, p.ops + (("transpose", self.dim0, self.dim1),),
                      _swap(p.dst_box, self.dim0, self.dim1))
                for p in self.part.pieces(child_box, shape_of)]

    def __str__(self):
        return f"transpose[{self.dim0},{self.dim1}]({self.part})"


def _replace_dim(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return shape[:dim] + (size,) + shape[dim + 1:]


def apply_ops(tensor, ops: tuple[tuple, ...]):
    """Apply a piece's ops to the tensor read for it (views only, no copy)."""
    for op in ops:
        if op[0] == "unsqueeze":
            tensor = tensor.unsqueeze(op[1])
        else:
            tensor = tensor.transpose(op[1], op[2])
    return tensor
