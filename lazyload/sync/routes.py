"""The sync plan: which boxes move between which ranks, and when, computed once from
metadata (each target rank's read items, as requests it addresses to each source rank: a
source reads only the requests of it, every rank a compact summary of each target's). Each rank's
`max_host_bytes` (default about one layer of its traffic) bounds its bytes per step on each
side: a target rank's requests come in windows of at most its budget (`requests_of`), and
a step holds at most one window of each target; a source rank's packed messages of a step,
summed over the targets it sends to, stay within its budget (`in_steps`, the same on every
rank from the same summaries). At step k every rank posts all its sends and receives of
step k, then waits for them, so that no pair can deadlock."""
from __future__ import annotations

import hashlib
from array import array
import math
from collections import deque
from dataclasses import dataclass, replace

import torch

from ..errors import PlanError
from ..expr import Box, box_numel, box_shape
from ..schedule import layer_of
from .source_index import Piece
from .wire import QuantizedWire, wire_bytes


@dataclass(frozen=True)
class Request:
    """A target rank asks source rank `source` for `box` of the piece stored as `key`, at `step`;
    `wire`: the narrower dtype the source casts it to before sending (the target's, which it
    would only cast to on arrival), or how it quantizes it (`wire.QuantizedWire`: the 8-bit
    data and scales its target would compute on arrival); None: sent as stored."""

    step: int
    source: int
    key: str
    box: Box
    itemsize: int  # of its dtype on the wire: the stored key's, or `wire` (quantized: its alignment)
    wire: torch.dtype | QuantizedWire | None = None

    @property
    def nbytes(self) -> int:
        return self.wire.nbytes(self.box) if isinstance(self.wire, QuantizedWire) else box_numel(self.box) * self.itemsize


def requests_of(items: list, pieces: dict[str, Piece], budget: int,
                wires: dict[int, torch.dtype] | None = None) -> list[Request]:
    """A target rank's requests, one per read item (in `items`' order, layer by layer), their
    `step` the window they fall in: windows of at most `budget` bytes as its messages pack
    them (a larger item alone). `in_steps` turns windows into steps. `wires`: the items
    (by position) sent cast to a narrower dtype, or quantized (their bytes on the wire count)."""
    out, window, held, ends = [], 0, 0, {}
    for position, item in enumerate(items):
        wire = (wires or {}).get(position)
        source, itemsize = pieces[item.entry.key].rank, (wire or item.entry.dtype).itemsize
        nbytes = wire_bytes(wire or item.entry.dtype, item.src_box)
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


def routes_for(me: int, mine: list[Request] | None, asked: dict[int, list[Request]],
               summaries: dict[int, "Summary | None"], max_host_bytes: dict[int, int | None]) -> Routes:
    """This rank's routes: what it receives, from its own requests (`mine`; None on a rank
    that holds no target), and what it sends, from the requests each target rank addressed
    to it (`asked`: target rank -> its requests of this rank, in its order), each checked
    against the digest its target published; their steps from every target's `Summary`
    (`in_steps`) and every rank's `max_host_bytes`."""
    stepped = in_steps({t: s.sized() for t, s in summaries.items() if s is not None}, max_host_bytes)
    steps_of = {t: [r.step for r in requests] for t, requests in stepped.items() if requests}
    sends: dict[int, dict[int, list[Request]]] = {}
    receives: dict[int, dict[int, list[int]]] = {}
    local: dict[int, list[int]] = {}
    for target, requests in sorted(asked.items()):
        if pair_digest(requests) != summaries[target].pairs.get(me):
            raise PlanError(f"WeightSync: rank {me} read rank {target}'s requests of it, which do not match the digest "
                            f"rank {target} published (another lazyload version there, or a store that lost a write); "
                            "every rank must run the same lazyload version; no byte moved.")
        mine_there = [step for step, r in zip(steps_of[target], stepped[target]) if r.source == me]
        for step, request in zip(mine_there, requests):
            sends.setdefault(step, {}).setdefault(target, []).append(replace(request, step=step))
    for position, request in enumerate(mine or ()):
        step = steps_of[me][position]
        if request.source == me:
            local.setdefault(step, []).append(position)
        else:
            receives.setdefault(step, {}).setdefault(request.source, []).append(position)
    steps = max((s[-1] + 1 for s in steps_of.values()), default=0)
    return Routes(steps, {s: {t: tuple(q) for t, q in by.items()} for s, by in sends.items()},
                  {s: {r: tuple(q) for r, q in by.items()} for s, by in receives.items()},
                  {s: tuple(q) for s, q in local.items()}, sync_digest(summaries, steps_of))


@dataclass(frozen=True)
class Sized:
    """Another target rank's request as `in_steps` needs it: its window, source, bytes and
    layer (`key`, enough for `layer_of`), not its key or box."""

    step: int
    source: int
    key: str
    itemsize: int
    nbytes: int
    box: Box = ()


@dataclass(frozen=True)
class Summary:
    """What a target rank tells every rank of its requests: per source rank it asks, the
    digest of the requests addressed to it (kept under a key of the pair, read by that source
    alone); and, in arrays, what `in_steps` needs of each request (window, source, bytes,
    itemsize, layer): a few bytes each, not its key and box."""

    pairs: dict[int, str]
    layers: tuple[str, ...]
    columns: tuple[array, ...]  # window, source, nbytes, itemsize, layer (its index in `layers`)

    @classmethod
    def of(cls, target: int, requests: list[Request]) -> "Summary":
        layers: dict[str, int] = {}
        columns = (array("i"), array("i"), array("q"), array("B"), array("i"))  # 4, 4, 8, 1, 4 bytes
        for r in requests:
            layer = layers.setdefault(layer_of(r.key.rpartition("@")[0]), len(layers))
            for column, value in zip(columns, (r.step, r.source, r.nbytes, r.itemsize, layer)):
                column.append(value)
        return cls({source: pair_digest(q) for source, q in sorted(addressed(target, requests).items())}, tuple(layers),
                   columns)

    def sized(self) -> list[Sized]:
        keys = [f"{layer}.@" for layer in self.layers]  # layer_of(key before "@") gives the layer back
        return [Sized(w, s, keys[k], i, n) for w, s, n, i, k in zip(*self.columns)]


def addressed(target: int, requests: list[Request]) -> dict[int, list[Request]]:
    """A target rank's requests of other source ranks, by the rank they ask (each in the
    target's order); its own copies (a colocated rank's) go over no wire."""
    out: dict[int, list[Request]] = {}
    for request in requests:
        if request.source != target:
            out.setdefault(request.source, []).append(request)
    return out


def pair_digest(requests: list[Request]) -> str:
    """The digest of one target rank's requests of one source rank."""
    digest = hashlib.sha256()
    for r in requests:
        wire = f"\0{r.wire}" if r.wire is not None else ""  # both ends agree on the bytes sent
        digest.update(f"{r.step}\0{r.source}\0{r.key}\0{r.box}{wire}\n".encode())
    return digest.hexdigest()[:16]


def sync_digest(summaries: dict[int, Summary | None], steps_of: dict[int, list[int]]) -> str:
    """The digest of the whole sync plan: every target rank's requests (by their pairs'
    digests) and the steps each runs at; every rank computes it from the same summaries."""
    digest = hashlib.sha256()
    for target, summary in sorted((r, s) for r, s in summaries.items() if s is not None):
        for source, pair in summary.pairs.items():
            digest.update(f"{target}\0{source}\0{pair}\n".encode())
        digest.update(array("q", steps_of.get(target, ())).tobytes())
    return digest.hexdigest()[:16]


def packed_offsets(specs: list[tuple[torch.dtype | QuantizedWire, Box]]) -> tuple[list[int], int]:
    """Where each (dtype, box) lands in one message: one after the other, each at a multiple
    of its itemsize (so that its bytes view as its dtype); and the message's bytes. A box
    quantized on the wire (`QuantizedWire`) holds its data and its scales."""
    offsets, end = [], 0
    for dtype, box in specs:
        start = -(-end // dtype.itemsize) * dtype.itemsize
        offsets.append(start)
        end = start + wire_bytes(dtype, box)
    return offsets, end


def slot(buffer: torch.Tensor, offset: int, dtype: torch.dtype, box: Box) -> torch.Tensor:
    """The bytes of one box in a packed message, seen as its dtype and shape."""
    shape = box_shape(box)
    return buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
