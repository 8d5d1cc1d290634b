"""The source side of a sync: each tensor a source holds (a module's state dict or a state
dict: plain tensors, DTensor TP, FSDP2 `fully_shard`, both over a 2-D mesh) as its global
shape, dtype and the boxes this rank holds, read off the DTensor placements alone; or a
Megatron-Core model's, as its `sharded_state_dict()` describes them (`megatron_source.py`)."""
from __future__ import annotations

import hashlib
import itertools
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ArgumentError
from ..expr import Box, box_numel, full_box
from ..plan import box_regions
from ..targets import is_dtensor, local_tensor
from ..tp.placements import dtensor_placement
from .megatron_source import MegatronTensor, is_megatron, megatron_tensors


@dataclass(frozen=True, slots=True)  # one per source box
class Held:
    """One box of a source tensor this rank holds: `box` of the global tensor, found at
    `local_start` of the rank's local tensor (`part`: which of its local tensors, where a
    Megatron MoE layer's experts are one parameter each; else 0)."""

    box: Box
    local_start: tuple[int, ...]
    part: int = 0


@dataclass(frozen=True)
class SourceTensor:
    """A source tensor as every rank sees it: name, dtype name, global shape, one rank's boxes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    held: tuple[Held, ...]
    # a Megatron-Core source's tensor (named by Megatron's checkpoint key, read as transformers'
    # tensors by the torch_dist reader's mapping): the model's attention heads; None otherwise
    megatron: Any = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.rpartition(".")[2])


def source_tensors(source: Any) -> dict[str, torch.Tensor | MegatronTensor]:
    """name -> tensor of a source: a module's state dict (FSDP2's holds its sharded DTensors),
    a Megatron-Core model's sharded tensors, or a state dict as given. Asked at every sync: a
    trainer may re-register its parameters."""
    if source is None:
        return {}
    if is_megatron(source):
        return megatron_tensors(source)
    tensors = source.state_dict(keep_vars=True) if isinstance(source, nn.Module) else source
    if not hasattr(tensors, "items"):
        raise ArgumentError(f"WeightSync(source=...) takes an nn.Module or a state dict of tensors, got "
                            f"{type(source).__name__}.")
    wrong = next((name for name, t in tensors.items() if not isinstance(t, torch.Tensor)), None)
    if wrong is not None:
        raise ArgumentError(f"WeightSync(source=...): {wrong!r} is a {type(tensors[wrong]).__name__}, not a tensor; "
                            "pass a state dict of tensors (plain or DTensor).")
    return dict(tensors)


def source_layout(tensors: dict[str, torch.Tensor | MegatronTensor]) -> list[SourceTensor]:
    """This rank's boxes of every source tensor (a plain tensor: the whole of it)."""
    out = []
    for name, tensor in tensors.items():
        if isinstance(tensor, MegatronTensor):
            held = tuple(Held(box, start, part) for box, start, part in tensor.held)
            out.append(SourceTensor(name, str(tensor.local.dtype), tensor.shape, held, tensor.heads))
            continue
        shape = tuple(tensor.shape)
        if is_dtensor(tensor):
            local_shape, regions = box_regions(name, shape, dtensor_placement(name, tensor).spans)
            held = tuple(Held(r.global_box, r.local_start) for r in regions)
            if tuple(local_tensor(tensor).shape) != local_shape:
                raise ArgumentError(f"WeightSync(source=...): {name}'s local shard has shape "
                                    f"{list(local_tensor(tensor).shape)}, its placements {tensor.placements} give "
                                    f"{list(local_shape)} (uneven shards padded?); sync from evenly placed tensors.")
        else:
            held = (Held(full_box(shape), (0,) * len(shape)),)
        out.append(SourceTensor(name, str(tensor.dtype), shape, tuple(h for h in held if box_numel(h.box))))
    return out


@dataclass(frozen=True)
class Strided:
    """The boxes of a tensor that `count` source ranks hold, one each, at the start of their
    local tensor: rank `first + i * stride` holds `base` with dim `dim` cut to its i-th step
    of `step` (torch.chunk's cut, as FSDP's: the last step shorter, any after it empty).
    One rule for what would be `count` boxes, one per rank."""

    first: int
    stride: int
    count: int
    base: Box
    dim: int
    step: int

    def rank(self, i: int) -> int:
        return self.first + i * self.stride

    def steps(self) -> int:
        """The steps holding a box (the ranks after them hold none)."""
        lo, hi = self.base[self.dim]
        return min(self.count, -(-(hi - lo) // self.step))

    def holds(self, rank: int) -> bool:
        """Whether `rank` is one of the rule's (its box may be empty)."""
        i, off = divmod(rank - self.first, self.stride)
        return off == 0 and 0 <= i < self.count

    def box(self, i: int) -> Box:
        lo, hi = self.base[self.dim]
        start = min(hi, lo + i * self.step)
        return self.base[:self.dim] + ((start, min(hi, start + self.step)),) + self.base[self.dim + 1:]

    def held(self) -> list[tuple[int, int, Box]]:
        """(i, rank, box) of each rank holding a box (not empty)."""
        return [(i, self.rank(i), self.box(i)) for i in range(self.count) if box_numel(self.box(i))]

    def overlapping(self, boxes: list[Box]) -> set[int]:
        """The steps i whose box overlaps any of `boxes` (found by arithmetic: a rule of
        thousands of ranks is not walked)."""
        out: set[int] = set()
        lo, hi = self.base[self.dim]
        for box in boxes:
            if not all(a < d and c < b for i, ((a, b), (c, d)) in enumerate(zip(self.base, box)) if i != self.dim):
                continue  # apart in another dim
            start, stop = max(lo, box[self.dim][0]), min(hi, box[self.dim][1])
            if start < stop:
                out.update(range((start - lo) // self.step, min(self.count, -(-(stop - lo) // self.step))))
        return out


@dataclass(frozen=True)
class RuledTensor:
    """A source tensor as every rank holding it holds it, in strided rules (`Strided`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    rules: tuple[Strided, ...]

    torch_dtype = SourceTensor.torch_dtype

    def held_by(self, rank: int) -> tuple[Held, ...]:
        return tuple(Held(box, (0,) * len(box)) for rule in self.rules for _, r, box in rule.held() if r == rank)


@dataclass(frozen=True)
class Rules:
    """The source tensors of the ranks `ranks` (every rank of a DeviceMesh), each in strided
    rules: what every rank of the mesh derives alike from the placements, published once
    (under its digest) instead of each rank's boxes."""

    ranks: tuple[int, ...]
    tensors: tuple[RuledTensor, ...]

    def digest(self) -> str:
        return hashlib.sha256(pickle.dumps(self, protocol=4)).hexdigest()[:16]


def strided(held: dict[int, tuple[Held, ...]]) -> tuple[Strided, ...] | None:
    """The boxes of one tensor every rank of `held` holds (rank -> its boxes) as strided rules,
    the fewest that any dim's cut gives; None where a rank holds several boxes, or one not
    at its local start. Boxes several ranks hold alike (replicated) are one rule per copy."""
    if any(len(h) > 1 or h and (any(h[0].local_start) or h[0].part) for h in held.values()):
        return None
    boxes = sorted((h[0].box, rank) for rank, h in held.items() if h)
    if not boxes:
        return ()
    return min((_strided_along(boxes, dim) for dim in range(len(boxes[0][0]))), key=len)


def _strided_along(boxes: list[tuple[Box, int]], dim: int) -> tuple[Strided, ...]:
    """`strided`'s rules cutting dim `dim`: the boxes alike in the other dims, each copy's
    spans in order, cut into runs of even steps over ranks of even strides."""
    groups: dict[tuple, dict[tuple[int, int], list[int]]] = {}
    for box, rank in boxes:
        groups.setdefault(box[:dim] + box[dim + 1:], {}).setdefault(box[dim], []).append(rank)
    out = []
    for rest, by_span in groups.items():
        spans = sorted(by_span)
        for copy in range(max(map(len, by_span.values()))):
            held = [(span, by_span[span][copy]) for span in spans if len(by_span[span]) > copy]
            while held:
                run = _run(held)
                (lo, _), first = held[0]
                step, hi = held[0][0][1] - lo, held[len(run) - 1][0][1]
                stride = held[1][1] - first if len(run) > 1 else 1
                out.append(Strided(first, stride, len(run), rest[:dim] + ((lo, hi),) + rest[dim:], dim, step))
                held = held[len(run):]
    return tuple(out)


def _run(held: list[tuple[tuple[int, int], int]]) -> list:
    """The longest start of `held` ((span, rank) in span order) that one `Strided` describes:
    spans of one step, each where the last ended (the last may be shorter), over ranks of
    one stride."""
    (lo, hi), first = held[0]
    step, run = hi - lo, held[:1]
    for i, ((a, b), rank) in enumerate(held[1:], 1):
        stride = held[1][1] - first
        if run[-1][0][1] - run[-1][0][0] != step or a != lo + i * step or b - a > step or stride == 0 or \
                rank != first + i * stride:
            break
        run.append(held[i])
    return run


_MESH_RULES: dict[tuple, tuple[Strided, ...] | None] = {}


def mesh_rules(tensors: dict[str, torch.Tensor | MegatronTensor]) -> Rules | None:
    """A source's tensors as every rank of their DeviceMesh holds them (`Rules`), derived
    from each DTensor's placements at every coordinate of its mesh; None where any is not a
    DTensor over one mesh, or its boxes are no strided rule. Derived once per distinct
    shape, placements and mesh (a model's layers repeat a few)."""
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors.values() if is_dtensor(t)}
    if len(meshes) != 1 or not all(is_dtensor(t) for t in tensors.values()):
        return None
    mesh = next(iter(meshes.values()))
    grid = mesh.mesh
    ranks = tuple(int(r) for r in grid.flatten().tolist())
    out = []
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        key = (shape, str(tensor.placements), ranks, tuple(grid.shape))
        if key not in _MESH_RULES:
            held = {}
            for coord in itertools.product(*map(range, grid.shape)):
                spans = dtensor_placement(name, tensor, coord).spans
                _, regions = box_regions(name, shape, spans)
                held[int(grid[coord])] = tuple(Held(r.global_box, r.local_start) for r in regions
                                               if box_numel(r.global_box))
            _MESH_RULES[key] = strided(held)
        rules = _MESH_RULES[key]
        if rules is None:
            return None
        out.append(RuledTensor(name, str(tensor.dtype), shape, rules))
    return Rules(ranks, tuple(out))


def local_of(tensor: torch.Tensor | MegatronTensor) -> torch.Tensor:
    """A source tensor's local shard, the tensor this rank holds."""
    return tensor.local if isinstance(tensor, MegatronTensor) else local_tensor(tensor)


def local_piece(tensor: torch.Tensor | MegatronTensor, held: Held, src_box: Box) -> torch.Tensor:
    """The view of `tensor`'s local shard holding `src_box` of the piece `held` (coordinates
    relative to the piece)."""
    local = (tensor.local_of(held.part) if isinstance(tensor, MegatronTensor) else local_tensor(tensor)).detach()
    return local[tuple(slice(s + a, s + b) for s, (a, b) in zip(held.local_start, src_box))]
