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
collective runs under `rank_timeout` (`agreement.wait_all`), so a worker that failed or died
makes the others raise a LazyLoadError (CollectiveError) within it, never hang.

Local files keep their own reads: the page cache is already shared between the workers."""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..agreement import bounded_collectives, wait_all
from ..errors import ExchangeError
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
    dim = next((d for d, (start, end) in enumerate(union) if end - start > 1), 0)
    start, end = union[dim]
    out = []
    for r in range(world):
        a, b = start + (end - start) * r // world, start + (end - start) * (r + 1) // world
        out.append(union[:dim] + ((a, b),) + union[dim + 1:] if a < b else None)
    return tuple(out)


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


def exchange(peers: Peers, layer: list[SharedTensor], fetched: dict[str, torch.Tensor], dtype_of,
             deliver) -> int:
    """One all_to_all: each rank sends every other the parts of its boxes it fetched
    (`fetched`: name -> this rank's fetch box); `deliver(name, box, part, values)` puts each
    part of this rank's boxes (its own fetch's too) where its copies go. Returns the bytes
    received from the others. Each message starts with the layer's tag (`layer_tag`): a
    worker that reached another layer is an ExchangeError, never values put in the wrong place."""
    import torch.distributed as dist

    me, tag = peers.rank, layer_tag(layer)
    for tensor, box, part in pieces(layer, me, me):
        deliver(tensor.name, box, part, fetched[tensor.name][within(part, tensor.fetch[me])])
    sends, send_sizes, recv_sizes = [], [], []
    for other in range(peers.world):
        out = [] if other == me else [tag] + [fetched[t.name][within(part, t.fetch[me])].reshape(-1).view(torch.uint8)
                                              for t, _, part in pieces(layer, me, other)]
        sends += out
        send_sizes.append(sum(p.numel() for p in out))
        recv_sizes.append(0 if other == me else tag.numel() + sum(box_numel(part) * dtype_of(t.name).itemsize
                                                                  for t, _, part in pieces(layer, other, me)))
    send = torch.cat([p.contiguous() for p in sends]) if sends else torch.empty(0, dtype=torch.uint8)
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    with bounded_collectives(peers.timeout):
        wait_all([dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=peers.group, async_op=True)],
                 f"TP rank {me}: the exchange of layer {layer_of(layer[0].name) or '(outside layers)'!r} with the other "
                 "TP workers (each fetches part of the row-parallel tensors; see the other workers' logs for why one "
                 "stopped)")
    offset = 0
    for other in range(peers.world):
        if other == me:
            continue
        if not torch.equal(received[offset:offset + tag.numel()], tag):
            raise ExchangeError(f"TP rank {me}: TP rank {other} sent another layer than "
                                f"{layer_of(layer[0].name) or '(outside layers)'!r} in the exchange of the row-parallel "
                                "tensors: the workers' copies came in different orders. Load with "
                                "model_loader_extra_config {'cooperative': False} and report it.")
        offset += tag.numel()
        for tensor, box, part in pieces(layer, other, me):
            dtype = dtype_of(tensor.name)
            n = box_numel(part) * dtype.itemsize
            chunk = received[offset:offset + n]
            chunk = chunk if offset % dtype.itemsize == 0 else chunk.clone()  # a dtype's view needs its alignment
            deliver(tensor.name, box, part, chunk.view(dtype).view(box_shape(part)))
            offset += n
    return received.numel() - tag.numel() * (peers.world - 1)


def layer_tag(layer: list[SharedTensor]) -> torch.Tensor:
    """8 bytes naming the layer's shared tensors (a CRC of their names)."""
    crc = zlib.crc32("\n".join(t.name for t in layer).encode())
    return torch.tensor([crc], dtype=torch.int64).view(torch.uint8)
