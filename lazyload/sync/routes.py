"""The sync plan: which boxes move between which ranks, and when, computed once from
metadata (every target rank's read items, exchanged at construction). Each rank's
`max_host_bytes` (default about one layer of its traffic) bounds its bytes per step on each
side: a target rank's requests come in windows of at most its budget (`requests_of`), and
a step holds at most one window of each target; a source rank's packed messages of a step,
summed over the targets it sends to, stay within its budget (`in_steps`, the same on every
rank from the same requests). At step k every rank posts all its sends and receives of
step k, then waits for them, so that no pair can deadlock."""
from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, replace

import torch

from ..errors import PlanError
from ..expr import Box, box_numel, box_shape
from ..schedule import layer_of
from .source_index import Piece


@dataclass(frozen=True)
class Request:
    """A target rank asks source rank `source` for `box` of the piece stored as `key`, at `step`;
    `wire`: the narrower dtype the source casts it to before sending (the target's, which it
    would only cast to on arrival), None: sent as stored."""

    step: int
    source: int
    key: str
    box: Box
    itemsize: int  # of its dtype on the wire: the stored key's, or `wire`
    wire: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return box_numel(self.box) * self.itemsize


def requests_of(items: list, pieces: dict[str, Piece], budget: int,
                wires: dict[int, torch.dtype] | None = None) -> list[Request]:
    """A target rank's requests, one per read item (in `items`' order, layer by layer), their
    `step` the window they fall in: windows of at most `budget` bytes as its messages pack
    them (a larger item alone). `in_steps` turns windows into steps. `wires`: the items
    (by position) sent cast to a narrower dtype."""
    out, window, held, ends = [], 0, 0, {}
    for position, item in enumerate(items):
        wire = (wires or {}).get(position)
        source, itemsize = pieces[item.entry.key].rank, (wire or item.entry.dtype).itemsize
        nbytes = box_numel(item.src_box) * itemsize
        grow = packed_growth(ends.get(source, 0), nbytes, itemsize)
        if held and held + grow > budget:
            window, held, ends, grow = window + 1, 0, {}, nbytes
        held += grow
        ends[source] = ends.get(source, 0) + grow
        out.append(Request(window, source, item.entry.key, item.src_box, itemsize, wire))
    return out


def packed_growth(end: int, nbytes: int, itemsize: int) -> int:
    """The bytes a box of `nbytes` adds to a message of `end` bytes (`packed_offsets`)."""
    return -(-end // itemsize) * itemsize + nbytes - end


def source_budgets(queues: dict[int, list[Request]], sizes: dict[int, list[int]],
                   max_host_bytes: dict[int, int | None]) -> dict[int, int]:
    """Each source rank's bytes per step (messages packed), from every target's requests and
    their `sizes`: its `max_host_bytes`, else about one layer of what it sends, never less
    than its largest request (as a load's default budget)."""
    sending: dict[int, int] = {}  # source -> its largest request, then its largest layer
    sent: dict[tuple[int, str], int] = {}  # (source, layer) -> bytes
    layers: dict[str, str] = {}  # stored key -> its tensor's layer
    for target, requests in queues.items():
        for r, nbytes in zip(requests, sizes[target]):
            if r.source == target:
                continue
            layer = layers.get(r.key)
            if layer is None:
                layer = layers[r.key] = layer_of(r.key.rpartition("@")[0])
            sent[r.source, layer] = sent.get((r.source, layer), 0) + nbytes
            sending[r.source] = max(sending.get(r.source, 0), nbytes)
    for (source, layer), nbytes in sent.items():
        if layer:  # outside numbered layers (embeddings, head): only the largest request counts
            sending[source] = max(sending[source], nbytes)
    return {r: max_host_bytes.get(r) or b for r, b in sending.items()}


def in_steps(wanted: dict[int, list[Request] | None],
             max_host_bytes: dict[int, int | None]) -> dict[int, list[Request] | None]:
    """`wanted` with the steps every rank runs. Step by step, the target ranks take their
    next request in turn (one each round, each in its own order, the first turn rotating),
    each from one window a step (`requests_of`: the target's budget), while the step's
    packed bytes of the request's source stay within its budget (`source_budgets`): a source's
    budget is shared by the targets it serves, and a window whose sources are busy spreads
    over several steps. No request exceeds its source's budget (targets cut larger items),
    so every step takes one."""
    queues = {t: q for t, q in sorted(wanted.items()) if q}
    sizes = {t: [r.nbytes for r in q] for t, q in queues.items()}
    sending = source_budgets(queues, sizes, max_host_bytes)
    taken = dict.fromkeys(queues, 0)
    out: dict[int, list[Request]] = {t: [] for t in queues}
    step, active = 0, list(queues)
    while active:
        window: dict[int, int] = {}  # target -> the window it takes from this step
        packed: dict[int, int] = {}  # source -> bytes of its messages this step
        ends: dict[tuple[int, int], int] = {}  # (source, target) -> their message's bytes so far
        first, took = step % len(active), 0  # each step's first turn to the next target: budgets shared fairly
        turns = deque(active[first:] + active[:first])  # the targets that may still take a request this step
        while turns:
            target = turns.popleft()
            i = taken[target]
            r = queues[target][i]
            if window.setdefault(target, r.step) != r.step:
                continue
            if r.source != target:
                end = ends.get((r.source, target), 0)
                grow = packed_growth(end, sizes[target][i], r.itemsize)
                if packed.get(r.source, 0) + grow > sending[r.source]:
                    continue
                packed[r.source], ends[r.source, target] = packed.get(r.source, 0) + grow, end + grow
            out[target].append(replace(r, step=step))
            taken[target], took = i + 1, took + 1
            if i + 1 < len(queues[target]):
                turns.append(target)
        if not took:
            t = active[first]
            r = queues[t][taken[t]]
            raise PlanError(f"WeightSync: {r.key} ({r.nbytes} bytes, rank {r.source} to rank {t}) exceeds the step "
                            f"budget of rank {r.source} ({sending.get(r.source)}): every rank must run the same "
                            "lazyload version.")
        active = [t for t in active if taken[t] < len(queues[t])]
        step += 1
    return {**wanted, **out}


@dataclass(frozen=True)
class Routes:
    """One rank's part of the sync plan: at each step, for each peer, what it sends (the
    requests of that target, in its order) and which of its own items it receives (their
    positions in its item list, in the sender's order); `local`: its items it is itself the
    source of (a colocated rank), copied without the wire."""

    steps: int
    sends: dict[int, dict[int, tuple[Request, ...]]]
    receives: dict[int, dict[int, tuple[int, ...]]]
    local: dict[int, tuple[int, ...]]
    digest: str


def routes_for(me: int, wanted: dict[int, list[Request] | None], max_host_bytes: dict[int, int | None]) -> Routes:
    """This rank's routes, from every target rank's requests (`wanted`: global rank -> its
    requests, None for a rank that holds no target) and every rank's `max_host_bytes`."""
    wanted = in_steps(wanted, max_host_bytes)
    sends: dict[int, dict[int, list[Request]]] = {}
    receives: dict[int, dict[int, list[int]]] = {}
    local: dict[int, list[int]] = {}
    steps = 0
    for target, requests in sorted((r, q) for r, q in wanted.items() if q):
        steps = max(steps, requests[-1].step + 1)
        for position, request in enumerate(requests):
            if request.source == me and target == me:
                local.setdefault(request.step, []).append(position)
            elif request.source == me:
                sends.setdefault(request.step, {}).setdefault(target, []).append(request)
            elif target == me:
                receives.setdefault(request.step, {}).setdefault(request.source, []).append(position)
    return Routes(steps, {s: {t: tuple(q) for t, q in by.items()} for s, by in sends.items()},
                  {s: {r: tuple(q) for r, q in by.items()} for s, by in receives.items()},
                  {s: tuple(q) for s, q in local.items()}, sync_digest(wanted))


def sync_digest(wanted: dict[int, list[Request] | None]) -> str:
    """The digest of the whole sync plan: equal on every rank (each one computes it from the
    same exchanged requests)."""
    digest = hashlib.sha256()
    for target, requests in sorted((r, q) for r, q in wanted.items() if q):
        for r in requests:
            wire = f"\0{r.wire}" if r.wire is not None else ""  # both ends agree on the bytes sent
            digest.update(f"{target}\0{r.step}\0{r.source}\0{r.key}\0{r.box}{wire}\n".encode())
    return digest.hexdigest()[:16]


def packed_offsets(specs: list[tuple[torch.dtype, Box]]) -> tuple[list[int], int]:
    """Where each (dtype, box) lands in one message: one after the other, each at a multiple
    of its itemsize (so that its bytes view as its dtype); and the message's bytes."""
    offsets, end = [], 0
    for dtype, box in specs:
        start = -(-end // dtype.itemsize) * dtype.itemsize
        offsets.append(start)
        end = start + box_numel(box) * dtype.itemsize
    return offsets, end


def slot(buffer: torch.Tensor, offset: int, dtype: torch.dtype, box: Box) -> torch.Tensor:
    """The bytes of one box in a packed message, seen as its dtype and shape."""
    shape = box_shape(box)
    return buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
