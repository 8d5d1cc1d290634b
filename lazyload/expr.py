"""Expressions: each model tensor as a small expression over checkpoint tensors.

A box (start, stop per dim) of the target pushed down through an expression gives the
minimal pieces to read: (checkpoint key, source box) -> (ops, destination box). Shape-level
operations (stack, concatenate, chunk, transpose) and one elementwise one (dequantize a
pre-quantized weight with the scales of its blocks) live here, so pushing a box down is
exact and no byte outside a rank's share is ever needed: a dequantized piece names the
scale blocks that cover its box, and nothing more.

One node is the exception, the fallback for any other operation (`Whole`: a conversion of
transformers' that no box goes through, e.g. an interleave or a RoPE permutation): its
sources are read whole and the operation runs on the rank, which keeps its box of the
result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

from .errors import PlanError

Box = tuple[tuple[int, int], ...]
ShapeOf = Callable[[str], tuple[int, ...]]  # checkpoint key -> shape


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_within(box: Box, shape: Sequence[int]) -> bool:
    """Whether `box` is a box of a tensor of `shape`: one span per dim, each inside it."""
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def groups_of(box: Box, sizes: Sequence[int]) -> Box:
    """The box, in the grid of groups of `sizes[d]` elements along each dim d (a scale grid,
    FP8 blocks), of the groups `box` starts and ends in and all between."""
    return tuple((a // size, -(-b // size)) for (a, b), size in zip(box, sizes))


def box_numel(box: Box) -> int:
    n = 1
    for start, stop in box:  # no shape tuple built: asked for every read item of a plan
        n *= stop - start
    return n


def _replace(box: Box, dim: int, span: tuple[int, int]) -> Box:
    return box[:dim] + (span,) + box[dim + 1:]


def _shift(box: Box, dim: int, offset: int) -> Box:
    start, stop = box[dim]
    return _replace(box, dim, (start + offset, stop + offset))


def _swap(seq: tuple, a: int, b: int) -> tuple:
    out = list(seq)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


# Not frozen: a frozen dataclass's __init__ costs three times as much, and a plan makes and
# drops one Piece (and ScaleRef) or more per read item (DeepSeek-V3: 45k); none is changed.
@dataclass(slots=True)  # no __dict__ each
class ScaleRef:
    """The scales of a dequantized piece: `box` of the scale tensor `key` (and the same box
    of the zero points `zero`, if any) covers the piece's source box; each scale entry
    stands for `block[d]` elements of the weight along dim d. A 4-bit packed weight
    (`Packed4`) also names its replicated global scale `glob`, read whole with every box,
    and its `codec` (how its bytes decode, `quant.packed4`)."""

    key: str
    box: Box
    zero: str | None
    block: tuple[int, ...]
    glob: str | None = None
    codec: str | None = None


@dataclass(slots=True)  # not frozen, no __dict__: see ScaleRef
class Piece:
    """Read `src_box` of checkpoint tensor `key`, dequantize it with `scales` if any, apply
    `ops` in order (("unsqueeze", d) or ("transpose", a, b)), and write the result to `dst_box`."""

    key: str
    src_box: Box
    ops: tuple[tuple, ...]
    dst_box: Box
    scales: ScaleRef | None = None

    def moved(self, ops: tuple[tuple, ...], dst_box: Box) -> Piece:
        """This piece with other ops and destination (what each node above it changes);
        `dataclasses.replace` costs several times more, for up to 100k pieces a plan."""
        return Piece(self.key, self.src_box, ops, dst_box, self.scales)


class Expr:
    __slots__ = ()  # a leaf (`Source`, one per stored key) needs no __dict__; nodes keep theirs

    def shape(self, shape_of: ShapeOf) -> tuple[int, ...]:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def first_key(self) -> str:
        """`keys()[0]`; a node of many parts (256 experts) answers without listing them all."""
        return self.keys()[0]

    def pieces(self, box: Box, shape_of: ShapeOf) -> list[Piece]:
        raise NotImplementedError

    def layout(self, shape_of: ShapeOf) -> tuple | None:
        """For a leaf, everything but its keys that its shape, its checks and its pieces depend
        on: leaves of equal layouts have one shape and give the same pieces for a box up to
        their keys (see `like`). None for a node that depends on more."""
        return None

    def like(self, piece: Piece, ops: tuple[tuple, ...], dst_box: Box) -> Piece:
        """This leaf's piece where a leaf of the same layout gave `piece`, with `ops` and `dst_box`."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Source(Expr):
    key: str

    def shape(self, shape_of):
        return tuple(shape_of(self.key))

    def keys(self):
        return [self.key]

    def pieces(self, box, shape_of):
        return [Piece(self.key, box, (), box)] if box_numel(box) else []

    def layout(self, shape_of):
        return (Source, tuple(shape_of(self.key)))

    def like(self, piece, ops, dst_box):
        return Piece(self.key, piece.src_box, ops, dst_box)

    def __str__(self):
        return self.key


@dataclass(frozen=True)
class Stack(Expr):
    """torch.stack(parts, dim): per-expert tensors into one 3D parameter."""

    parts: tuple[Expr, ...]
    dim: int = 0

    def shape(self, shape_of):
        return self._measure(shape_of)[0]

    def _measure(self, shape_of: ShapeOf) -> tuple[tuple[int, ...], bool]:
        """(shape, whether the parts are leaves of one layout), remembered for the last
        shape_of: a push-down asks once per region (Cat's offsets), and each answer checks
        every part (256 experts). Compared with ==: the mapping and the plan each ask with
        the index's own `index.shape_of`, a new bound method each time."""
        memo = self.__dict__.get("_measured")
        if memo is not None and memo[0] == shape_of:
            return memo[1]
        layouts = {p.layout(shape_of) for p in self.parts}
        alike = len(layouts) == 1 and None not in layouts
        # Parts of one layout have one shape and pass the same checks: the first answers for all.
        shapes = {self.parts[0].shape(shape_of)} if alike else {p.shape(shape_of) for p in self.parts}
        if len(shapes) != 1:
            raise ValueError(f"stack of tensors with different shapes {sorted(shapes)}")
        part = shapes.pop()
        measured = (part[:self.dim] + (len(self.parts),) + part[self.dim:], alike)
        object.__setattr__(self, "_measured", (shape_of, measured))
        return measured

    def __getstate__(self):  # the memo holds a function, and is no part of the value
        return {k: v for k, v in self.__dict__.items() if k != "_measured"}

    def keys(self):
        return [k for p in self.parts for k in p.keys()]

    def first_key(self):
        return self.parts[0].first_key()

    def pieces(self, box, shape_of):
        start, stop = box[self.dim]
        child_box = box[:self.dim] + box[self.dim + 1:]
        unsqueeze = ("unsqueeze", self.dim)
        if start < stop and self._measure(shape_of)[1]:
            # The experts of a layer: the box is pushed down through the first part only,
            # and each part takes that answer with its own keys.
            first = [(p, p.ops + (unsqueeze,), p.dst_box[:self.dim], p.dst_box[self.dim:])
                     for p in self.parts[start].pieces(child_box, shape_of)]
            return [self.parts[i].like(p, ops, head + ((i, i + 1),) + tail)
                    for i in range(start, stop) for p, ops, head, tail in first]
        out = []
        for i in range(start, stop):
            for p in self.parts[i].pieces(child_box, shape_of):
                dst = p.dst_box[:self.dim] + ((i, i + 1),) + p.dst_box[self.dim:]
                out.append(p.moved(p.ops + (unsqueeze,), dst))
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

    def first_key(self):
        return self.parts[0].first_key()

    def pieces(self, box, shape_of):
        start, stop = box[self.dim]
        out, offset = [], 0
        for part in self.parts:
            size = part.shape(shape_of)[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                child_box = _replace(box, self.dim, (lo - offset, hi - offset))
                if type(part) is Source:  # a stored key (a logical tensor's thousands of boxes): its one piece
                    if box_numel(child_box):
                        out.append(Piece(part.key, child_box, (), _replace(box, self.dim, (lo, hi))))
                else:
                    for p in part.pieces(child_box, shape_of):
                        out.append(p.moved(p.ops, _shift(p.dst_box, self.dim, offset)))
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
        return [p.moved(p.ops, _shift(p.dst_box, self.dim, -offset))
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
        return [p.moved(p.ops + (("transpose", self.dim0, self.dim1),), _swap(p.dst_box, self.dim0, self.dim1))
                for p in self.part.pieces(child_box, shape_of)]

    def __str__(self):
        return f"transpose[{self.dim0},{self.dim1}]({self.part})"


@dataclass(frozen=True)
class Dequant(Expr):
    """A pre-quantized weight in full precision: `(weight.float() - zero) * scale`, each
    element with the scale (and zero point) of its block, where `block[d]` weight elements
    along dim d share one scale entry (tail blocks may be partial). The scale tensor has one
    entry per block (the grid `ceil(shape / block)`), or a single entry for the whole weight."""

    weight: str
    scale: str
    block: tuple[int, ...]
    zero: str | None = None

    def shape(self, shape_of):
        shape = tuple(shape_of(self.weight))
        if len(self.block) != len(shape) or min(self.block, default=1) < 1:
            raise ValueError(f"block {list(self.block)} does not fit a weight of shape {list(shape)}")
        grid = tuple(-(-n // b) for n, b in zip(shape, self.block))
        scale = tuple(shape_of(self.scale))
        if scale != grid and math.prod(scale) != 1:
            raise ValueError(f"scale {self.scale} has shape {list(scale)}, but blocks of {list(self.block)} "
                             f"over {list(shape)} need {list(grid)}")
        if self.zero is not None and tuple(shape_of(self.zero)) != scale:
            raise ValueError(f"zero point {self.zero} has shape {list(shape_of(self.zero))}, its scale {list(scale)}")
        return shape

    def keys(self):
        return [self.weight, self.scale] + ([self.zero] if self.zero is not None else [])

    def pieces(self, box, shape_of):
        if not box_numel(box):
            return []
        scale_shape = tuple(shape_of(self.scale))
        if math.prod(scale_shape) == 1:  # one scale for the whole weight
            scale_box = full_box(scale_shape)
        else:  # the blocks the box starts and ends in, and all between
            scale_box = groups_of(box, self.block)
        return [Piece(self.weight, box, (), box, ScaleRef(self.scale, scale_box, self.zero, self.block))]

    def layout(self, shape_of):
        return (Dequant, tuple(shape_of(self.weight)), tuple(shape_of(self.scale)), self.block,
                None if self.zero is None else tuple(shape_of(self.zero)))

    def like(self, piece, ops, dst_box):
        return Piece(self.weight, piece.src_box, ops, dst_box, ScaleRef(self.scale, piece.scales.box, self.zero, self.block))

    def __str__(self):
        return f"dequant({self.weight}, {self.scale}" + (f", {self.zero})" if self.zero else ")")


def check_whole_groups(key: str, what: str, start: int, stop: int, group: int, groups: int) -> None:
    """Columns `start`:`stop` of a weight quantized in `groups` groups of `group` input columns
    must hold whole groups (one scale per group cannot be split): else a PlanError naming
    the worlds whose even splits keep them whole."""
    if start % group or stop % group:
        raise PlanError(f"{key}: columns {start}:{stop} cut its {what} groups of {group}; a split of its "
                        f"{groups * group} input columns must keep whole groups: use a world that divides {groups} "
                        f"(one of {[w for w in range(1, groups + 1) if groups % w == 0]}).")


MX_GROUP = 32  # MXFP4: values per E8M0 scale, packed 16 bytes to a group


@dataclass(frozen=True)
class Mxfp4(Expr):
    """An MXFP4 weight in full precision [..., R, K] from its packed E2M1 `blocks`
    [..., R, K/32, 16] and E8M0 `scales` [..., R, K/32] (`quant.fp4`). A box must hold whole
    groups of 32 along K: it reads those groups' bytes and scales, nothing more; a box
    that cuts a group (a split of K into shares that are no multiple of 32) is refused."""

    blocks: str
    scales: str

    def shape(self, shape_of):
        blocks, scales = tuple(shape_of(self.blocks)), tuple(shape_of(self.scales))
        if len(blocks) < 3 or blocks[-1] != MX_GROUP // 2 or scales != blocks[:-1]:
            raise ValueError(f"MXFP4 blocks {self.blocks} {list(blocks)} and scales {self.scales} {list(scales)} "
                             f"are not [..., K/{MX_GROUP}, {MX_GROUP // 2}] and [..., K/{MX_GROUP}]")
        return blocks[:-2] + (blocks[-2] * MX_GROUP,)

    def keys(self):
        return [self.blocks, self.scales]

    def pieces(self, box, shape_of):
        if not box_numel(box):
            return []
        start, stop = box[-1]
        check_whole_groups(self.blocks, "MXFP4", start, stop, MX_GROUP, shape_of(self.scales)[-1])
        groups = box[:-1] + ((start // MX_GROUP, stop // MX_GROUP),)
        return [Piece(self.blocks, groups + ((0, MX_GROUP // 2),), (), box,
                      ScaleRef(self.scales, groups, None, (1,) * (len(box) - 1) + (MX_GROUP,)))]

    def layout(self, shape_of):
        return (Mxfp4, tuple(shape_of(self.blocks)))

    def like(self, piece, ops, dst_box):
        return Piece(self.blocks, piece.src_box, ops, dst_box,
                     ScaleRef(self.scales, piece.scales.box, None, piece.scales.block))

    def __str__(self):
        return f"mxfp4({self.blocks}, {self.scales})"


@dataclass(frozen=True)
class Packed4(Expr):
    """A 4-bit weight packed along its input (last) dim, in full precision [..., R, K]:
    `packed` [..., R, K/per] (`per` values to an element: E2M1 two to a uint8, INT4 eight to
    an int32), one `scales` entry per `group` values [..., R, K/group], and `glob`, a global
    scale of one entry read whole with every box (None: none); `codec` names the dequantizer
    (`quant.packed4`). A box must hold whole groups along K: it reads those groups' packed
    elements and scales, nothing more; a box that cuts a group is refused."""

    packed: str
    scales: str
    glob: str | None
    codec: str
    group: int
    per: int

    def shape(self, shape_of):
        packed, scales = tuple(shape_of(self.packed)), tuple(shape_of(self.scales))
        k = packed[-1] * self.per if packed else 0
        if len(packed) < 2 or k % self.group or scales != packed[:-1] + (k // self.group,):
            raise ValueError(f"{self.codec} weight {self.packed} {list(packed)} and scales {self.scales} "
                             f"{list(scales)} are not [..., K/{self.per}] and [..., K/{self.group}]")
        return packed[:-1] + (k,)

    def keys(self):
        return [self.packed, self.scales] + ([self.glob] if self.glob is not None else [])

    def pieces(self, box, shape_of):
        if not box_numel(box):
            return []
        start, stop = box[-1]
        check_whole_groups(self.packed, self.codec, start, stop, self.group, shape_of(self.scales)[-1])
        packed = box[:-1] + ((start // self.per, stop // self.per),)
        groups = box[:-1] + ((start // self.group, stop // self.group),)
        return [Piece(self.packed, packed, (), box, ScaleRef(self.scales, groups, None, (1,) * (len(box) - 1)
                                                             + (self.group,), self.glob, self.codec))]

    def layout(self, shape_of):
        return (Packed4, tuple(shape_of(self.packed)), self.glob is None, self.codec, self.group, self.per)

    def like(self, piece, ops, dst_box):
        s = piece.scales
        return Piece(self.packed, piece.src_box, ops, dst_box, ScaleRef(self.scales, s.box, None, s.block, self.glob,
                                                                         self.codec))

    def __str__(self):
        return f"{self.codec}({self.packed}, {self.scales}" + (f", {self.glob})" if self.glob else ")")


@dataclass(frozen=True)
class Whole(Expr):
    """Output `output` of an operation no box can be pushed through, computed from the whole
    of its sources: `sources` are (input group, expression) pairs in the order the operation
    takes them, `run` the operation ([(group, tensor), ...] -> {output name: tensor}: for a
    transformers model, its own conversion). Pushing any box down reads every source whole,
    each piece in its source's own coordinates (`position` says which source a key belongs
    to); the result is computed on the rank, which keeps its box (`placer.WholeDest`). Its
    shape comes from running the operation on meta tensors."""

    sources: tuple[tuple[int, Expr], ...]
    output: str
    run: Callable[[list[tuple[int, Any]]], dict[str, Any]] = field(compare=False, repr=False)
    label: str = field(default="", compare=False)

    def compute(self, tensors: Sequence[Any]) -> Any:
        """The output from the sources' full tensors (in `sources` order)."""
        return self.run([(group, t) for (group, _), t in zip(self.sources, tensors)])[self.output]

    def shape(self, shape_of):
        import torch

        metas = [torch.empty(s.shape(shape_of), device="meta") for _, s in self.sources]
        return tuple(self.compute(metas).shape)

    def keys(self):
        return [k for _, s in self.sources for k in s.keys()]

    def position(self, key: str) -> int:
        """Which source checkpoint key `key` belongs to (an index into `sources`)."""
        return self._positions[key]

    @cached_property
    def _positions(self) -> dict[str, int]:  # asked once per read item landing (placer.WholeDest)
        return {k: i for i, (_, s) in enumerate(self.sources) for k in s.keys()}

    def pieces(self, box, shape_of):
        if not box_numel(box):
            return []
        return [p for _, s in self.sources for p in s.pieces(full_box(s.shape(shape_of)), shape_of)]

    def __str__(self):
        shown = ", ".join(str(s) for _, s in self.sources[:3]) + (" .." if len(self.sources) > 3 else "")
        return f"whole[{self.label or 'operation'}]({shown})"


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


def undo_ops(tensor, ops: tuple[tuple, ...]):
    """The inverse of `apply_ops`: a piece's destination box seen in the layout of its
    source box (a view, so that writing to it writes the destination)."""
    for op in reversed(ops):
        if op[0] == "unsqueeze":
            tensor = tensor.squeeze(op[1])
        else:
            tensor = tensor.transpose(op[1], op[2])
    return tensor
