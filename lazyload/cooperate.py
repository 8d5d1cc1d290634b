"""Ranks that need the same bytes read them once. The ranks of a (dp, tp) mesh with the
same `tp` coordinate (replicas of one shard) have the same plan: they split its targets,
balanced by bytes layer by layer (every rank computes the same split from its plan); a
plain target larger than a replica's fair share of its layer (an embedding, a head) is cut
into row ranges, one per replica, split like targets. A
target every rank of the mesh holds whole (a norm, a replicated embedding) is read by one
rank of the whole mesh, spread over all of them. Each rank reads its part from storage into
its destinations, and once every rank has read its part (the agreement's "read" point) the
targets are broadcast from their readers (over the `dp` group, or the whole mesh for the
replicated ones) straight into the destinations (torch.distributed collectives: gloo on
CPU, NCCL on GPU).

A target is the unit: whatever its destination holds once read (a plain tensor, 8-bit data
and scales, the result of a conversion) is what is broadcast, so every destination kind
cooperates without knowing it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from .agreement import wait_all
from .digest import check_messages, message_bytes
from .expr import Whole
from .mapping import natural_key
from .placer import Destination, TensorDest
from .schedule import Group, layer_of


@dataclass(frozen=True)
class Circle:
    """Ranks that hold the same targets: their process group (None: the default group) and
    this rank's index in it."""

    group: Any
    me: int


@dataclass(frozen=True)
class Share:
    """This rank's part of the reads it shares: `readers` maps each target to the index of
    its reader in its circle, `dp` (the replicas of this shard), or `everyone` (the whole
    mesh) for the targets of `replicated` (their layers, in the same order on every rank)."""

    readers: dict[str, int]
    dp: Circle
    everyone: Circle | None = None
    replicated: tuple[tuple[str, ...], ...] = ()
    rows: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # split targets' row ranges
    sizes: dict[str, int] = field(default_factory=dict)  # each target's message bytes, as the plan says

    @cached_property
    def replicated_names(self) -> frozenset[str]:
        return frozenset(n for layer in self.replicated for n in layer)

    def reads(self, name: str) -> bool:
        """This rank reads target `name` from storage."""
        circle = self.everyone if self.everyone is not None and name in self.replicated_names else self.dp
        return self.readers[name] == circle.me

    def own(self, groups: list[Group]) -> list[Group]:
        """The groups, each with the items of the targets (and row ranges of split targets)
        this rank reads (empty ones dropped)."""
        mine = {name for name in self.readers if self.reads(name)}
        return [Group(g.layer, kept) for g in groups if (kept := tuple(self._mine(g.items, mine)))]

    def _mine(self, items, mine: set[str]):
        for item in items:
            if item.target not in self.rows:
                yield from [item] if item.target in mine else []
                continue
            for i, rows in enumerate(self.rows[item.target]):
                piece = cut_rows(item, rows)
                if piece is not None and self.readers[piece_name(item.target, i)] == self.dp.me:
                    yield piece


def piece_name(target: str, index: int) -> str:
    return f"{target}#{index}"


def cut_rows(item: Any, rows: tuple[int, int]) -> Any:
    """The part of `item` that lands in rows [start, end) of its target (dim 0), or None."""
    (dst_start, dst_end), src_start = item.dst_box[0], item.src_box[0][0]
    start, end = max(dst_start, rows[0]), min(dst_end, rows[1])
    if start >= end:
        return None
    shift = src_start - dst_start
    return replace(item, src_box=((start + shift, end + shift), *item.src_box[1:]),
                   dst_box=((start, end), *item.dst_box[1:]))


def row_ranges(rows: int, parts: int) -> tuple[tuple[int, int], ...]:
    """`rows` cut into `parts` ranges of (nearly) equal length."""
    bounds = [rows * i // parts for i in range(parts + 1)]
    return tuple((a, b) for a, b in zip(bounds, bounds[1:]) if a < b)


def splittable(plan: Any, name: str, items: list) -> bool:
    """A plain target (no conversion, not quantized) whose items copy rows as they are: its
    row ranges can be read by different replicas."""
    return name not in plan.quantized and not isinstance(plan.mapping.exprs.get(name), Whole) and all(
        not i.ops and i.scales is None and i.dst_box and len(i.src_box) == len(i.dst_box)
        and i.dst_box[0][1] - i.dst_box[0][0] == i.src_box[0][1] - i.src_box[0][0] for i in items)


def large_targets(plan: Any, replicas: int, skip: frozenset[str]) -> dict[str, tuple[tuple[int, int], ...]]:
    """Targets larger than a replica's fair share of their layer, cut into row ranges (one
    per replica), so that one tensor (an embedding, a head) does not unbalance the split."""
    if replicas == 1:
        return {}
    rows = {}
    for group in plan.groups:
        sizes: dict[str, int] = {}
        for item in group.items:
            sizes[item.target] = sizes.get(item.target, 0) + item.nbytes
        for name, nbytes in sizes.items():
            items = [i for i in group.items if i.target == name]
            if name not in skip and nbytes * replicas > group.nbytes and splittable(plan, name, items):
                rows[name] = row_ranges(max(i.dst_box[0][1] for i in items), replicas)
    return rows


def split_reads(groups: list[Group], replicas: int, skip: frozenset[str] = frozenset(),
                rows: dict[str, tuple[tuple[int, int], ...]] | None = None) -> dict[str, int]:
    """Each target's reader among `replicas` ranks (those in `skip` left out), and each row
    range's (`piece_name`) of the targets cut into `rows`: layer by layer, the largest first,
    each to the rank that has the fewest bytes so far."""
    rows = rows or {}
    sizes: dict[str, int] = {}
    layers = []
    for group in groups:
        names = []
        for unit, nbytes in _units(group.items, skip, rows):
            names += [] if unit in sizes else [unit]
            sizes[unit] = sizes.get(unit, 0) + nbytes
        layers.append(sorted(names, key=lambda n: (-sizes[n], n)))
    return _greedy(layers, sizes, replicas)


def _units(items, skip: frozenset[str], rows: dict[str, tuple[tuple[int, int], ...]]):
    """(unit, bytes) of each item: its target, or the row ranges of a target cut into rows."""
    for item in items:
        if item.target in rows:
            for i, rng in enumerate(rows[item.target]):
                if (piece := cut_rows(item, rng)) is not None:
                    yield piece_name(item.target, i), piece.nbytes
        elif item.target not in skip:
            yield item.target, item.nbytes


def split_replicated(sizes: dict[str, int], ranks: int) -> tuple[dict[str, int], tuple[tuple[str, ...], ...]]:
    """Readers among `ranks` for targets every rank holds whole (name -> bytes, the same on
    every rank), and their layers in one order for all ranks."""
    layers: dict[str, list[str]] = {}
    for name in sorted(sizes, key=lambda n: (natural_key(layer_of(n)), -sizes[n], n)):
        layers.setdefault(layer_of(name), []).append(name)
    ordered = tuple(tuple(names) for names in layers.values())
    return _greedy(ordered, sizes, ranks), ordered


def _greedy(layers, sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Each name (layer by layer, in order) to the rank with the fewest bytes so far."""
    totals = [0] * ranks
    readers: dict[str, int] = {}
    for layer in layers:
        for name in layer:
            readers[name] = min(range(ranks), key=lambda r: (totals[r], r))
            totals[readers[name]] += sizes[name]
    return readers


def share_of(plan: Any, mesh: Any) -> Share | None:
    """This rank's Share of its plan's reads over a ("dp", "tp") `mesh`. Targets every rank
    holds whole are split over the whole mesh when it is the whole process group (its
    default group runs their broadcasts), else over the replicas like the others. None for
    a model that holds its own split (DTensors, local shapes: FSDP shards over "dp" too), whose
    replicas need not hold the same bytes."""
    import torch.distributed as dist

    resolved = plan.placements
    if resolved.local_shaped or any(p.kind == "box" for p in resolved.placements.values()):
        return None
    dp = mesh["dp"]
    everyone = sorted(mesh.mesh.flatten().tolist())
    whole: dict[str, int] = {}
    if mesh["tp"].size() > 1 and everyone == list(range(dist.get_world_size())):
        whole = {t.name: 0 for t in plan.targets if _held_whole(plan, t)}
        for item in plan.items:
            if item.target in whole:
                whole[item.target] += item.nbytes
    rows = large_targets(plan, dp.size(), frozenset(whole))
    readers = split_reads(plan.groups, dp.size(), skip=frozenset(whole), rows=rows)
    if not whole:
        return Share(readers, Circle(dp.get_group(), dp.get_local_rank()), rows=rows, sizes=message_bytes(plan))
    replicated_readers, replicated = split_replicated(whole, len(everyone))
    return Share({**readers, **replicated_readers}, Circle(dp.get_group(), dp.get_local_rank()),
                 Circle(None, dist.get_rank()), replicated, rows, message_bytes(plan))


def _held_whole(plan: Any, target: Any) -> bool:
    """Every tensor-parallel rank holds this target whole (the same bytes)."""
    placement = plan.placements.placements.get(target.name)
    return (placement is None or placement.kind == "replicate") and \
        tuple(target.local_shape) == tuple(plan.specs[target.name].shape)


class Staging:
    """Contiguous copies of destinations that are not contiguous, in flight at once: at most
    `limit` bytes (the host budget: reading is over, its buffers free), `peak` the most held."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_contiguous():
            return tensor
        self.held += tensor.nbytes
        self.peak = max(self.peak, self.held)
        return tensor.contiguous()

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.is_contiguous() or self.held + tensor.nbytes <= self.limit


def exchange(groups: list[Group], share: Share, dests: dict[str, Destination], budget: int) -> tuple[int, int]:
    """Broadcast every target from its reader to the ranks that did not read it, one layer
    at a time (its broadcasts in flight together, their staging copies within `budget`
    bytes); returns the bytes this rank received and the most staging bytes it held at once."""
    check_messages(share.sizes, dests)
    replicated = share.replicated_names
    received = 0
    staging = Staging(budget)
    for layer in groups:
        names = [n for n in dict.fromkeys(item.target for item in layer.items) if n not in replicated]
        received += _broadcast_all(*_pieces_of(names, share, dests), share.readers, share.dp, staging)
    for names in share.replicated:  # the same order on every rank of the mesh
        received += _broadcast_all(list(names), dests, share.readers, share.everyone, staging)
    return received, staging.peak


def _pieces_of(names: list[str], share: Share, dests: dict[str, Destination]) -> tuple[list[str], dict]:
    """The names to broadcast and their destinations: a target cut into row ranges as its
    ranges (`piece_name`s, views of its tensor)."""
    pieces = {n: dests[n] for n in names if n not in share.rows}
    for name in names:
        tensor = dests[name].tensors(name)[name] if name in share.rows else None
        for i, (start, end) in enumerate(share.rows.get(name, ())):
            pieces[piece_name(name, i)] = TensorDest(tensor[start:end])
    return list(pieces), pieces


def _broadcast_all(names: list[str], dests: dict[str, Destination], readers: dict[str, int], circle: Circle,
                   staging: Staging) -> int:
    received = 0
    pending: list = []
    for name in names:
        for tensor in dests[name].tensors(name).values():
            for piece in pieces(tensor, staging.limit):
                if not staging.fits(piece):
                    _finish(pending, staging)  # every rank stages the same pieces: the same waits
                pending.append(_broadcast(piece, readers[name], circle.group, staging))
            received += tensor.nbytes if readers[name] != circle.me else 0
    _finish(pending, staging)
    return received


def _finish(pending: list, staging: Staging) -> None:
    """Wait for the broadcasts in flight (bounded: `wait_all`); staged copies go to their
    destinations and are freed."""
    wait_all([work for work, _, _ in pending], "the replicas' exchange")
    for work, staged, tensor in pending:
        if staged is not tensor:
            tensor.copy_(staged)
    pending.clear()
    staging.held = 0


def pieces(tensor: torch.Tensor, limit: int):
    """`tensor` whole when within `limit` bytes, else views of it (runs of rows, rows of rows)
    of at most `limit` bytes each (at least one element). By shape alone, whatever the
    strides, so that every rank broadcasts the same pieces."""
    if tensor.nbytes <= limit or tensor.dim() == 0:
        yield tensor
    elif tensor.shape[0] == 1:
        yield from pieces(tensor[0], limit)
    else:
        rows = max(1, limit // tensor[0].nbytes)
        for start in range(0, tensor.shape[0], rows):
            yield from pieces(tensor[start:start + rows], limit)


def _broadcast(tensor: torch.Tensor, source: int, group: Any, staging: Staging) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Start broadcasting `tensor`'s bytes from the group's rank `source`, as bytes (exact for
    every dtype, float8 included); a tensor that is not contiguous goes through a contiguous copy."""
    import torch.distributed as dist

    staged = staging.stage(tensor)
    as_bytes = staged.reshape(-1).view(torch.uint8)
    return dist.broadcast(as_bytes, group=group, group_src=source, async_op=True), staged, tensor
