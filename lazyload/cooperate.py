"""Ranks that need the same bytes read them once. The ranks of a (dp, tp) mesh with the
same `tp` coordinate (replicas of one shard) have the same plan: they split its targets,
balanced by bytes layer by layer (every rank computes the same split from its plan, in
O(items log dp): a heap of the replicas' loads); a plain target larger than a replica's
fair share of its layer (an embedding, a head, a large projection) is cut into one row
range per replica, each replica reading one range of it. A target every rank of the mesh
holds whole (a norm, a replicated embedding) is read by one rank of the whole mesh, spread
over all of them. Each rank reads its part from storage into its destinations, and once
every rank has read its part (the agreement's "read" point) each reader sends, per layer,
everything it read of that layer in one broadcast (over the `dp` group, or the whole mesh
for the replicated targets; torch.distributed collectives: gloo on CPU, NCCL on GPU).

A target is the unit: whatever its destination holds once read (a plain tensor, 8-bit data
and scales, the result of a conversion) is what is sent, as bytes, so every destination
kind cooperates without knowing it; a float32 target read from bfloat16 goes as the
bfloat16 bytes it was read from and is widened on arrival."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any

import torch

from .agreement import wait_all
from .digest import check_messages, message_bytes
from .expr import Whole, box_numel
from .mapping import natural_key
from .placer import Destination
from .schedule import Group, layer_of


@dataclass(frozen=True)
class Circle:
    """Ranks that hold the same targets: their process group (None: the default group) and
    this rank's index in it."""

    group: Any
    me: int


@dataclass(frozen=True)
class Rows:
    """A target cut into `parts` row ranges (dim 0) of (nearly) equal length, one per
    replica: range i is read by replica (first + i) % parts, so that the ranges one
    replica reads of a layer's large targets are a rotation, balanced to a row each."""

    count: int
    parts: int
    first: int

    def range(self, i: int) -> tuple[int, int]:
        return self.count * i // self.parts, self.count * (i + 1) // self.parts

    def reader(self, i: int) -> int:
        return (self.first + i) % self.parts

    def of(self, reader: int) -> tuple[int, int]:
        """The range `reader` reads (empty when the target has fewer rows than replicas)."""
        return self.range((reader - self.first) % self.parts)


@dataclass(frozen=True)
class Share:
    """This rank's part of the reads it shares: `readers` maps each target to the index of
    its reader in its circle, `dp` (the replicas of this shard), or `everyone` (the whole
    mesh) for the targets of `replicated` (their layers, in the same order on every rank);
    `rows` the targets cut into row ranges, `wire` the targets sent in a narrower dtype
    than they are held in (the checkpoint's)."""

    readers: dict[str, int]
    dp: Circle
    everyone: Circle | None = None
    replicated: tuple[tuple[str, ...], ...] = ()
    rows: dict[str, Rows] = field(default_factory=dict)
    wire: dict[str, torch.dtype] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # each target's message bytes, as the plan says

    @cached_property
    def replicated_names(self) -> frozenset[str]:
        return frozenset(n for layer in self.replicated for n in layer)

    def reads(self, name: str) -> bool:
        """This rank reads (whole) target `name` from storage."""
        circle = self.everyone if self.everyone is not None and name in self.replicated_names else self.dp
        return self.readers[name] == circle.me

    def own(self, groups: list[Group]) -> list[Group]:
        """The groups, each with the items of the targets (and this rank's row range of the
        targets cut into rows) this rank reads (empty ones dropped)."""
        return [Group(g.layer, kept) for g in groups if (kept := tuple(self._mine(g.items)))]

    def _mine(self, items):
        for item in items:
            rows = self.rows.get(item.target)
            if rows is None:
                yield from [item] if self.reads(item.target) else []
            elif (piece := cut_rows(item, rows.of(self.dp.me))) is not None:
                yield piece


def cut_rows(item: Any, rows: tuple[int, int]) -> Any:
    """The part of `item` that lands in rows [start, end) of its target (dim 0), or None."""
    (dst_start, dst_end), src_start = item.dst_box[0], item.src_box[0][0]
    start, end = max(dst_start, rows[0]), min(dst_end, rows[1])
    if start >= end:
        return None
    shift = src_start - dst_start
    return replace(item, src_box=((start + shift, end + shift), *item.src_box[1:]),
                   dst_box=((start, end), *item.dst_box[1:]))


def splittable(plan: Any, name: str, items: list) -> bool:
    """A plain target (no conversion, not quantized) whose items copy rows as they are: its
    row ranges can be read by different replicas."""
    return name not in plan.quantized and not isinstance(plan.mapping.exprs.get(name), Whole) and all(
        not i.ops and i.scales is None and i.dst_box and len(i.src_box) == len(i.dst_box)
        and i.dst_box[0][1] - i.dst_box[0][0] == i.src_box[0][1] - i.src_box[0][0] for i in items)


def split_reads(groups: list[Group], replicas: int, can_split=lambda name, items: False,
                skip: frozenset[str] = frozenset()) -> tuple[dict[str, int], dict[str, Rows]]:
    """Each target's reader among `replicas` ranks (those in `skip` left out), layer by
    layer: a target larger than a replica's fair share of its layer that `can_split`
    (name, items) is cut into row ranges (`Rows`, one per replica); the others, the largest
    first, each to the replica with the fewest bytes so far."""
    rows: dict[str, Rows] = {}
    sizes: dict[str, int] = {}
    layers = []
    for group in groups:
        whole = []
        targets = _by_target(group.items)
        layer_bytes = sum(nbytes for _, nbytes in targets.values())
        for name, (items, nbytes) in targets.items():
            if name in skip:
                continue
            if replicas > 1 and nbytes * replicas > layer_bytes and can_split(name, items):
                rows[name] = Rows(max(item.dst_box[0][1] for item in items), replicas, len(rows) % replicas)
            else:
                sizes[name] = nbytes
                whole.append(name)
        layers.append(sorted(whole, key=lambda n: (-sizes[n], n)))
    return _greedy(layers, sizes, replicas), rows


def _by_target(items) -> dict[str, tuple[list, int]]:
    """The items of each target, in the order they come, and their bytes."""
    out: dict[str, tuple[list, int]] = {}
    for item in items:
        its, nbytes = out.get(item.target, ([], 0))
        its.append(item)
        out[item.target] = its, nbytes + item.nbytes
    return out


def split_replicated(sizes: dict[str, int], ranks: int) -> tuple[dict[str, int], tuple[tuple[str, ...], ...]]:
    """Readers among `ranks` for targets every rank holds whole (name -> bytes, the same on
    every rank), and their layers in one order for all ranks."""
    layers: dict[str, list[str]] = {}
    for name in sorted(sizes, key=lambda n: (natural_key(layer_of(n)), -sizes[n], n)):
        layers.setdefault(layer_of(name), []).append(name)
    ordered = tuple(tuple(names) for names in layers.values())
    return _greedy(ordered, sizes, ranks), ordered


def _greedy(layers, sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Each name (layer by layer, in order) to the rank with the fewest bytes so far (the
    lowest such rank): a heap of (bytes, rank), so O(names log ranks)."""
    loads = [(0, rank) for rank in range(ranks)]  # sorted: already a heap
    readers: dict[str, int] = {}
    for layer in layers:
        for name in layer:
            load, rank = loads[0]
            readers[name] = rank
            heapq.heapreplace(loads, (load + sizes[name], rank))
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
    whole_job = mesh["tp"].size() > 1 and everyone == list(range(dist.get_world_size()))
    return share_for(plan, Circle(dp.get_group(), dp.get_local_rank()), dp.size(),
                     Circle(None, dist.get_rank()) if whole_job else None, len(everyone))


def share_for(plan: Any, dp: Circle, replicas: int, everyone: Circle | None = None, ranks: int = 0) -> Share:
    """The Share of `plan`'s reads among `replicas` ranks (this one `dp.me`), and, with
    `everyone`, of the targets every rank holds whole among the `ranks` of the whole mesh.
    From the plan alone: every rank of a circle computes the same."""
    whole = _held_whole_bytes(plan) if everyone is not None else {}
    readers, rows = split_reads(plan.groups, replicas, partial(splittable, plan), frozenset(whole))
    if not whole:
        return Share(readers, dp, rows=rows, wire=wire_dtypes(plan), sizes=message_bytes(plan))
    replicated_readers, replicated = split_replicated(whole, ranks)
    return Share({**readers, **replicated_readers}, dp, everyone, replicated, rows, wire_dtypes(plan), message_bytes(plan))


def _held_whole_bytes(plan: Any) -> dict[str, int]:
    """The bytes of each target every tensor-parallel rank holds whole (the same bytes)."""
    whole = {t.name: 0 for t in plan.targets if _held_whole(plan, t)}
    for item in plan.items:
        if item.target in whole:
            whole[item.target] += item.nbytes
    return whole


def _held_whole(plan: Any, target: Any) -> bool:
    placement = plan.placements.placements.get(target.name)
    return (placement is None or placement.kind == "replicate") and \
        tuple(target.local_shape) == tuple(plan.specs[target.name].shape)


def wire_dtypes(plan: Any) -> dict[str, torch.dtype]:
    """Targets held in float32 whose every element is copied from bfloat16 as it is (a cast:
    no dequantization, no conversion, nothing left as the model initialised it): they go
    as the bfloat16 bytes read (half the float32 bytes), exact both ways."""
    held = {t.name: t for t in plan.targets if plan.dtypes.get(t.name) == torch.float32
            and t.name not in plan.quantized and not isinstance(plan.mapping.exprs.get(t.name), Whole)}
    stored: dict[str, set] = {}
    covered: dict[str, int] = {}
    for item in plan.items:
        if item.target in held:
            stored.setdefault(item.target, set()).add(None if item.scales is not None else item.entry.dtype)
            covered[item.target] = covered.get(item.target, 0) + box_numel(item.dst_box)
    return {name: torch.bfloat16 for name, t in held.items() if stored.get(name) == {torch.bfloat16}
            and covered[name] == box_numel(tuple((0, n) for n in t.local_shape))}


@dataclass(frozen=True)
class Part:
    """A tensor (or rows of one) a reader sends, and its dtype on the wire."""

    tensor: torch.Tensor
    wire: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.wire.itemsize


def _aligned(n: int, part: Part) -> int:
    """The offset at or after `n` where `part` starts in a packed batch: a multiple of its
    wire itemsize, so that its bytes view as its dtype (no padding between parts of one dtype)."""
    return -(-n // part.wire.itemsize) * part.wire.itemsize


@dataclass(frozen=True)
class Batch:
    """What one collective carries: parts of one reader, packed one after the other, at
    most the staging budget in all; or one part sent as it is."""

    reader: int
    parts: tuple[Part, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        offsets, end = [], 0
        for part in self.parts:
            offsets.append(_aligned(end, part))
            end = offsets[-1] + part.nbytes
        return tuple(offsets)

    @property
    def nbytes(self) -> int:
        return self.offsets[-1] + self.parts[-1].nbytes

    @property
    def direct(self) -> bool:
        """One contiguous part in its own dtype: broadcast from and into its own memory."""
        part = self.parts[0]
        return len(self.parts) == 1 and part.tensor.is_contiguous() and part.wire == part.tensor.dtype


class Staging:
    """Packed batches in flight at once: at most `limit` bytes (the host budget: reading is
    over, its buffers free), `peak` the most held."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.peak = 0

    def stage(self, batch: Batch) -> torch.Tensor:
        self.held += batch.nbytes
        self.peak = max(self.peak, self.held)
        return torch.empty(batch.nbytes, dtype=torch.uint8, device=batch.parts[0].tensor.device)

    def fits(self, batch: Batch) -> bool:
        return batch.direct or self.held + batch.nbytes <= self.limit


def exchange(groups: list[Group], share: Share, dests: dict[str, Destination], budget: int) -> tuple[int, int]:
    """Send every target from its reader to the ranks that did not read it, one layer at a
    time, one broadcast per reader and layer (`layer_batches`; their packed copies within
    `budget` bytes); returns the bytes this rank received (as sent) and the most staging
    bytes it held at once."""
    check_messages(share.sizes, dests)  # before the first collective: sizes as the plan says
    received = 0
    staging = Staging(budget)
    for circle, batches in layer_batches(groups, share, dests, budget):
        received += _broadcast_all(batches, circle, staging)
    return received, staging.peak


def layer_batches(groups: list[Group], share: Share, dests: dict[str, Destination], limit: int):
    """(circle, batches) of each layer, in the same order on every rank: the targets of the
    `dp` group's layers, then the replicated layers over the whole mesh; per reader, its
    parts of the layer in at most `limit` bytes a batch (usually one)."""
    replicated = share.replicated_names
    for layer in groups:
        names = [n for n in dict.fromkeys(item.target for item in layer.items) if n not in replicated]
        yield share.dp, batches(parts_by_reader(names, share, dests), limit)
    for names in share.replicated:  # the same order on every rank of the mesh
        yield share.everyone, batches(parts_by_reader(list(names), share, dests), limit)


def parts_by_reader(names: list[str], share: Share, dests: dict[str, Destination]) -> dict[int, list[Part]]:
    """Each reader's parts of the targets `names`: their destination tensors (a target cut
    into rows as its row ranges), in the dtype they go in."""
    out: dict[int, list[Part]] = {}
    for name in names:
        rows = share.rows.get(name)
        for tensor in dests[name].tensors(name).values():
            wire = share.wire.get(name, tensor.dtype) if tensor.dtype == torch.float32 else tensor.dtype
            if rows is None:
                out.setdefault(share.readers[name], []).append(Part(tensor, wire))
                continue
            for i in range(rows.parts):
                start, end = rows.range(i)
                if start < end:
                    out.setdefault(rows.reader(i), []).append(Part(tensor[start:end], wire))
    return out


def batches(parts: dict[int, list[Part]], limit: int) -> list[Batch]:
    """Each reader's parts (readers in order) packed into batches of at most `limit` bytes;
    a part larger than that goes as `pieces` of it. By shapes and dtypes alone, so that every
    rank makes the same batches."""
    out = []
    for reader in sorted(parts):
        held: list[Part] = []
        end = 0  # the packed bytes of `held` (as Batch.nbytes counts them)
        for part in parts[reader]:
            for piece in pieces(part.tensor, limit):
                piece = Part(piece, part.wire)
                if held and _aligned(end, piece) + piece.nbytes > limit:
                    out.append(Batch(reader, tuple(held)))
                    held, end = [], 0
                end = _aligned(end, piece) + piece.nbytes
                held.append(piece)
        out += [Batch(reader, tuple(held))] if held else []
    return out


def _broadcast_all(batches: list[Batch], circle: Circle, staging: Staging) -> int:
    received = 0
    pending: list = []
    for batch in batches:
        if not staging.fits(batch):
            _finish(pending, staging)
        pending.append(_broadcast(batch, circle, staging))
        received += batch.nbytes if batch.reader != circle.me else 0
    _finish(pending, staging)
    return received


def _finish(pending: list, staging: Staging) -> None:
    """Wait for the broadcasts in flight (bounded: `wait_all`); a receiver's packed batches
    go to their destinations, and the staging is freed."""
    wait_all([work for work, _, _, _ in pending], "the replicas' exchange")
    for work, batch, packed, received in pending:
        if received and packed is not None:
            unpack(batch, packed)
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


def _broadcast(batch: Batch, circle: Circle, staging: Staging) -> tuple[Any, Batch, torch.Tensor | None, bool]:
    """Start broadcasting `batch` from its reader, as bytes (exact for every dtype, float8
    included): a direct batch from and into its tensor, else through a packed buffer (the
    reader packs it; a receiver unpacks it once received). Returned with the work: the
    buffer, held until the work is done, and whether this rank receives."""
    import torch.distributed as dist

    receives = batch.reader != circle.me
    if batch.direct:
        payload, packed = batch.parts[0].tensor.reshape(-1).view(torch.uint8), None
    else:
        payload = packed = staging.stage(batch)
        if not receives:
            pack(batch, packed)
    work = dist.broadcast(payload, group=circle.group, group_src=batch.reader, async_op=True)
    return work, batch, packed, receives


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integers: copies are bitwise


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    bits = _BITS.get(tensor.dtype.itemsize)
    return tensor if bits is None or tensor.dtype == bits else tensor.view(bits)


def _slot(batch: Batch, packed: torch.Tensor, i: int) -> torch.Tensor:
    """Part `i`'s bytes in `packed`, seen in its wire dtype and shape."""
    part, offset = batch.parts[i], batch.offsets[i]
    return packed[offset:offset + part.nbytes].view(part.wire).view(part.tensor.shape)


def pack(batch: Batch, packed: torch.Tensor) -> None:
    """The reader's parts into `packed`: their bytes, or for a narrower wire dtype the
    bytes they were read from."""
    for i, part in enumerate(batch.parts):
        slot = _slot(batch, packed, i)
        if part.wire == part.tensor.dtype:
            _bits(slot).copy_(_bits(part.tensor))
        else:
            narrow_into(slot, part.tensor)


def unpack(batch: Batch, packed: torch.Tensor) -> None:
    """A received batch into its destinations (widened where it came narrower)."""
    for i, part in enumerate(batch.parts):
        slot = _slot(batch, packed, i)
        if part.wire == part.tensor.dtype:
            _bits(part.tensor).copy_(_bits(slot))
        else:
            part.tensor.copy_(slot)


def narrow_into(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """`tensor`'s float32 values, read from bfloat16, into `out` as the bfloat16 bytes they
    came from: the cast is exact for them but for a NaN, whose bits (which casts do not keep)
    are its upper half, so that widening them again gives `tensor`'s bits."""
    out.copy_(tensor)
    nan = tensor.isnan()
    if nan.any():
        out.view(torch.int16)[nan] = (tensor.view(torch.int32)[nan] >> 16).to(torch.int16)
