"""Tensors that the tensor-parallel workers of an engine read from a URL, fetched once and
shared over the engine's own TP group (vLLM's `get_tp_group().cpu_group`, gloo).

A row-parallel worker's box of a row-major tensor (the column half of every row) is not
one byte range: fetched exactly it is a GET per row, merged (`merge_gap`) it is nearly the
whole tensor. Instead, once every worker's weight loaders have recorded their copies, the
workers gather each other's boxes (one all_gather), and every tensor some worker's box
cuts that way (`strided`) is split: each worker fetches one contiguous range of rows of the
union of the workers' boxes (its 1/TP; `fetch_boxes`), and per layer one all_to_all sends
each worker the parts of its boxes that the others fetched. Every worker computes the same
plan from the gathered boxes, so all issue the same collectives in the same order; each
collective runs under `rank_timeout` (`agreement.wait_all`), so a worker that failed, died
or stalls makes the others raise a LazyLoadError (CollectiveError) within it, never hang.

A layer's fetch, send and receive buffers (at TP 2 as many bytes as the layer's shared
tensors, fewer at a larger TP) stay within `max_host_bytes` when it is set: a layer whose
buffers would not fit it is exchanged in rounds (`rounds`), each a few of its tensors or 1/k
of every worker's rows of one tensor, each round's buffers released before the next. At a
reload each worker also keeps its boxes' values of the layer until vLLM copies them
(`SharedReload`): the rounds leave room for them, and a budget that cannot hold them beside
one row's exchange is a PlanError before any fetch.

Local files keep their own reads: the page cache is already shared between the workers."""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..agreement import bounded_collectives, wait_all
from ..errors import ExchangeError, PlanError
from ..expr import box_numel, box_shape
from ..index import natural_key
from ..schedule import layer_of
from .lazy_tensor import Box


@dataclass(frozen=True)
class Peers:
    """The engine's TP group (gloo), this worker's rank in it, its size, and the seconds any
    collective may take (`rank_timeout`)."""

    group: Any
    rank: int
    world: int
    timeout: float


@dataclass(frozen=True)
class SharedTensor:
    """A checkpoint tensor fetched in parts: `fetch[r]` the box rank r fetches (None: nothing),
    `boxes[r]` the distinct boxes rank r's loaders copied."""

    name: str
    fetch: tuple[Box | None, ...]
    boxes: tuple[tuple[Box, ...], ...]


def strided(box: Box, shape: tuple[int, ...]) -> bool:
    """`box` is not one contiguous byte range of the row-major tensor: past its leading dims of
    one index and the first dim it cuts, some dim is not whole."""
    first = 0
    while first < len(box) - 1 and box[first][1] - box[first][0] == 1:
        first += 1
    return any(box[d] != (0, shape[d]) for d in range(first + 1, len(box)))


def fetch_boxes(union: Box, world: int) -> tuple[Box | None, ...]:
    """`union` cut into `world` contiguous ranges of its first dim longer than one (nearly
    equal; None where a rank gets no row)."""
    dim = long_dim(union)
    start, end = union[dim]
    out = []
    for r in range(world):
        a, b = start + (end - start) * r // world, start + (end - start) * (r + 1) // world
        out.append(union[:dim] + ((a, b),) + union[dim + 1:] if a < b else None)
    return tuple(out)


def long_dim(box: Box) -> int:
    """The first dim of `box` longer than one (its rows, cut among the ranks), else 0."""
    return next((d for d, (start, end) in enumerate(box) if end - start > 1), 0)


def plan_shared(boxes_by_rank: list[list[tuple[str, Box]]], shape_of) -> dict[str, SharedTensor]:
    """The tensors to share, in natural order: those every rank copies from and some rank's box
    cuts strided. The same on every rank (from the gathered boxes alone)."""
    world = len(boxes_by_rank)
    by_name: dict[str, list[list[Box]]] = {}
    for rank, boxes in enumerate(boxes_by_rank):
        for name, box in boxes:
            by_name.setdefault(name, [[] for _ in range(world)])[rank].append(tuple(map(tuple, box)))
    shared = {}
    for name in sorted(by_name, key=natural_key):
        per_rank, shape = by_name[name], tuple(shape_of(name))
        if not all(per_rank) or not any(strided(b, shape) for boxes in per_rank for b in boxes):
            continue
        every = [b for boxes in per_rank for b in boxes]
        union = tuple((min(b[d][0] for b in every), max(b[d][1] for b in every)) for d in range(len(shape)))
        shared[name] = SharedTensor(name, fetch_boxes(union, world), tuple(tuple(dict.fromkeys(b)) for b in per_rank))
    return shared


def by_layer(shared: dict[str, SharedTensor]) -> list[list[SharedTensor]]:
    """The shared tensors grouped by layer, layers in natural order (the same on every rank)."""
    layers: dict[str, list[SharedTensor]] = {}
    for tensor in shared.values():
        layers.setdefault(layer_of(tensor.name), []).append(tensor)
    return [layers[key] for key in sorted(layers, key=natural_key)]


ALIGN = 8  # each part of a message starts at a multiple of it: a view of any dtype of the buffer, no copy
TAG = 8  # the bytes of a round's tag (`round_tag`) that start each message


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def message_bytes(tensors: list[SharedTensor], source: int, target: int, dtype_of) -> int:
    """The bytes `source` sends `target` in a round of `tensors`: the tag, then each part padded."""
    return TAG + sum(padded(box_numel(part) * dtype_of(t.name).itemsize)
                     for t, _, part in pieces(tensors, source, target))


def buffer_bytes(tensor: SharedTensor, world: int, dtype_of) -> list[int]:
    """Per rank, the bytes of `tensor` it holds in a round: its fetch and the parts it sends
    and receives (without the tags)."""
    itemsize = dtype_of(tensor.name).itemsize
    out = []
    for rank in range(world):
        fetch = 0 if tensor.fetch[rank] is None else box_numel(tensor.fetch[rank]) * itemsize
        moved = sum(message_bytes([tensor], a, b, dtype_of) - TAG for other in range(world) if other != rank
                    for a, b in ((rank, other), (other, rank)))
        out.append(fetch + moved)
    return out


def kept_bytes(tensor: SharedTensor, world: int, dtype_of) -> list[int]:
    """Per rank, the bytes of its boxes of `tensor`: the values a reload keeps from the
    tensor's first round until vLLM copies them (`SharedReload`)."""
    itemsize = dtype_of(tensor.name).itemsize
    return [sum(box_numel(box) for box in tensor.boxes[rank]) * itemsize for rank in range(world)]


def cut(tensor: SharedTensor, k: int) -> list[SharedTensor]:
    """`tensor` in k parts, the i-th fetching the i-th of k ranges of every rank's fetch rows."""
    per_rank = [[None] * k if box is None else fetch_boxes(box, k) for box in tensor.fetch]
    return [SharedTensor(tensor.name, tuple(p[i] for p in per_rank), tensor.boxes) for i in range(k)]


def rounds(layer: list[SharedTensor], world: int, dtype_of, budget: int,
           keep: bool = False) -> list[list[SharedTensor]]:
    """The layer's shared tensors in rounds, in order, whose buffers (fetch + send + receive,
    tags included) fit `budget` on every rank; a tensor that does not fit alone is `cut` into
    as many parts as it takes, a round each. With `keep` (a reload) each rank's values of the
    layer's tensors so far (`kept_bytes`, from a tensor's first round to the layer's end) fit
    beside each round's buffers too. The same on every rank (from the plan alone). A budget
    smaller than one row's exchange (and the values kept) is a PlanError (before any byte is
    fetched)."""
    tags = 2 * (world - 1) * TAG
    out, current, held, kept = [], [], [tags] * world, [0] * world
    for tensor in layer:
        cost = buffer_bytes(tensor, world, dtype_of)
        if keep:
            kept = [k + v for k, v in zip(kept, kept_bytes(tensor, world, dtype_of))]
        if max(k + h + c for k, h, c in zip(kept, held, cost)) <= budget:
            current.append(tensor)
            held = [h + c for h, c in zip(held, cost)]
            continue
        if current:
            out.append(current)
        current, held = [tensor], [tags + c for c in cost]
        if max(k + h for k, h in zip(kept, held)) <= budget:
            continue
        current, held = [], [tags] * world
        out += [[part] for part in cut_to_fit(tensor, world, dtype_of, budget, max(cost), max(kept))]
    return out + ([current] if current else [])


def layer_rounds(shared: dict[str, SharedTensor], world: int, dtype_of, max_host_bytes: int | None,
                 keep: bool = False) -> list[list[list[SharedTensor]]]:
    """Each layer's `rounds` (`by_layer`'s order) under `max_host_bytes` (`keep`: a reload's);
    by default a layer is one round (its buffers: 1/TP of its shared tensors fetched, and its
    parts sent and received, are at most the layer's bytes, the default budget, but for the tags)."""
    return [[layer] if max_host_bytes is None else rounds(layer, world, dtype_of, max_host_bytes, keep)
            for layer in by_layer(shared)]


def cut_to_fit(tensor: SharedTensor, world: int, dtype_of, budget: int, cost: int,
               kept: int = 0) -> list[SharedTensor]:
    """`tensor` (whose buffers take `cost` bytes on the busiest rank) cut into about the fewest
    parts (`cut`) whose buffers and tags fit `budget` on every rank, beside `kept` bytes of a
    reload's values."""
    tags, room = 2 * (world - 1) * TAG, budget - kept
    rows = max(box[long_dim(box)][1] - box[long_dim(box)][0] for box in tensor.fetch if box is not None)
    k = min(max(-(-cost // max(room - tags, 1)), 2), rows)
    while True:
        held = max(max(buffer_bytes(part, world, dtype_of)) for part in cut(tensor, k)) + tags
        if held <= room:
            return cut(tensor, k)
        if k == rows:
            break
        k = min(rows, k + max(1, k // 8))  # the padding and uneven cuts may take a few more parts than cost / budget
    if kept:
        raise PlanError(f"max_host_bytes={budget} cannot hold, at a reload, a TP worker's values of the row-parallel "
                        f"tensors of layer {layer_of(tensor.name)!r} up to {tensor.name} ({kept} bytes, kept until "
                        f"vLLM copies them) beside the exchange of one row of it ({held} bytes: fetched, sent and "
                        f"received); raise it to at least {kept + held}, or load with model_loader_extra_config "
                        "{'cooperative': False}.")
    raise PlanError(f"max_host_bytes={budget} is smaller than the TP workers' exchange of one row of {tensor.name} "
                    f"({held} bytes: fetched, sent and received); raise it to at least that, or load with "
                    "model_loader_extra_config {'cooperative': False}.")


def gather_boxes(peers: Peers, boxes: list[tuple[str, Box]]) -> list[list[tuple[str, Box]]]:
    """Every rank's boxes (two all_gathers: the sizes, then the padded JSON), under the deadline."""
    import torch.distributed as dist

    mine = torch.frombuffer(bytearray(json.dumps(boxes).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(peers.world)]
    with bounded_collectives(peers.timeout):
        wait_all([dist.all_gather(sizes, torch.tensor([mine.numel()]), group=peers.group, async_op=True)],
                 f"TP rank {peers.rank}: the TP workers' gather of their boxes")
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:mine.numel()] = mine
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(peers.world)]
        wait_all([dist.all_gather(out, padded, group=peers.group, async_op=True)], f"TP rank {peers.rank}: the TP workers' gather of their boxes")
    return [json.loads(t[:int(n)].numpy().tobytes().decode()) for t, n in zip(out, sizes)]


def overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(start < end for start, end in box) else None


def within(box: Box, outer: Box) -> tuple[slice, ...]:
    """`box` as slices of a tensor holding `outer`."""
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(box, outer))


def pieces(layer: list[SharedTensor], source: int, target: int):
    """(tensor, box, part) of what `source` fetched that `target`'s box `box` holds, in one
    order for both ranks."""
    for tensor in layer:
        fetched = tensor.fetch[source]
        if fetched is None:
            continue
        for box in tensor.boxes[target]:
            part = overlap(fetched, box)
            if part is not None:
                yield tensor, box, part


def exchange(peers: Peers, tensors: list[SharedTensor], fetched: dict[str, torch.Tensor], dtype_of,
             deliver) -> tuple[int, int]:
    """One all_to_all of a round (`rounds`) of a layer's shared tensors: each rank sends every
    other the parts of its boxes it fetched (`fetched`: name -> this rank's fetch box);
    `deliver(name, box, part, values)` puts each part of this rank's boxes (its own fetch's
    too) where its copies go. Returns the tensor bytes received from the others and the bytes
    of the round's buffers (fetch, send and receive). Each message starts with the round's tag
    (`round_tag`): a worker that reached another layer is an ExchangeError, never values put
    in the wrong place."""
    import torch.distributed as dist

    me, tag, layer = peers.rank, round_tag(tensors), layer_of(tensors[0].name) or "(outside layers)"
    for tensor, box, part in pieces(tensors, me, me):
        deliver(tensor.name, box, part, fetched[tensor.name][within(part, tensor.fetch[me])])
    send_sizes = [0 if other == me else message_bytes(tensors, me, other, dtype_of) for other in range(peers.world)]
    recv_sizes = [0 if other == me else message_bytes(tensors, other, me, dtype_of) for other in range(peers.world)]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    offset = 0
    for other in range(peers.world):
        if other != me:
            send[offset:offset + TAG] = tag
            offset += TAG
            for t, _, part in pieces(tensors, me, other):
                offset += put(send, offset, fetched[t.name][within(part, t.fetch[me])])
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    with bounded_collectives(peers.timeout):
        wait_all([dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=peers.group, async_op=True)],
                 f"TP rank {me}: the exchange of layer {layer!r} with the other TP workers (each fetches part of the "
                 "row-parallel tensors; see the other workers' logs for why one stopped)")
    offset = got = 0
    for other in range(peers.world):
        if other == me:
            continue
        if not torch.equal(received[offset:offset + TAG], tag):
            raise ExchangeError(f"TP rank {me}: TP rank {other} sent another layer than {layer!r} (or another round "
                                "of it) in the exchange of the row-parallel tensors: the workers' copies came in "
                                "different orders. Load with model_loader_extra_config {'cooperative': False} and "
                                "report it.")
        offset += TAG
        for tensor, box, part in pieces(tensors, other, me):
            dtype = dtype_of(tensor.name)
            n = box_numel(part) * dtype.itemsize
            deliver(tensor.name, box, part, received[offset:offset + n].view(dtype).view(box_shape(part)))
            offset, got = offset + padded(n), got + n
    return got, sum(v.nbytes for v in fetched.values()) + send.numel() + received.numel()


def put(buffer: torch.Tensor, offset: int, values: torch.Tensor) -> int:
    """Copy `values` into the bytes of `buffer` at `offset` (a multiple of ALIGN), with no
    copy in between; returns the bytes taken, padded."""
    n = values.numel() * values.element_size()
    buffer[offset:offset + n].view(values.dtype).view(values.shape).copy_(values)
    return padded(n)


def round_tag(tensors: list[SharedTensor]) -> torch.Tensor:
    """8 bytes naming a round: a CRC of its tensors' names and fetch boxes."""
    crc = zlib.crc32(json.dumps([(t.name, t.fetch) for t in tensors]).encode())
    return torch.tensor([crc], dtype=torch.int64).view(torch.uint8)
