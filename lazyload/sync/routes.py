"""The sync plan: which boxes move between which ranks, and when, computed once from
metadata, each rank from what its own pairs need: a target rank's read items become
requests it addresses to each source rank (a source reads only the requests of it), and
every rank reads of each target only a digest and its number of steps (`Summary`). Each
rank's `max_host_bytes` (default about one layer of its traffic) bounds its bytes per step
on each side: a target rank's requests come in windows of at most its budget
(`requests_of`), and a step holds at most part of one window; a source rank's budget is
shared among the target ranks it serves (`source_slots`), so that its packed messages of a
step, summed over them, stay within it, and each target assigns its own steps within its
sources' slots (`own_steps`); the source takes the steps from the requests it reads. At
step k every rank posts all its sends and receives of step k, then waits for them, so that
no pair can deadlock."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ..errors import PlanError
from ..expr import Box, box_shape
from ..schedule import layer_of
from .source_index import Piece
from .wire import QuantizedWire, Scratch, wire_bytes


@dataclass(frozen=True, slots=True)  # a server rank of a large job makes thousands: no __dict__ each
class Request:
    """A target rank asks source rank `source` for `box` of the piece stored as `key`, at `step`;
    `wire`: the narrower dtype the source casts it to before sending (the target's, which it
    would only cast to on arrival), or how it quantizes it (`wire.QuantizedWire`: the 8-bit
    data and scales its target would compute on arrival); None: sent as stored."""

    step: int
    source: int
    key: str
    box: Box
    dtype: torch.dtype  # the stored key's
    wire: torch.dtype | QuantizedWire | None = None
    nbytes: int = field(init=False, repr=False, compare=False)  # on the wire, sized once

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", wire_bytes(self.wire or self.dtype, self.box))

    @property
    def itemsize(self) -> int:
        """Of its dtype on the wire: the stored key's, or `wire`'s (quantized: its alignment)."""
        return (self.wire or self.dtype).itemsize

    def __reduce__(self):
        """Pickled as its fields alone (the source sizes it again as it reads it)."""
        return Request, (self.step, self.source, self.key, self.box, self.dtype, self.wire)

    def at(self, step: int) -> "Request":
        """This request at `step` (its size kept, not computed again)."""
        if step == self.step:
            return self
        moved = object.__new__(Request)
        for name in Request.__slots__:
            object.__setattr__(moved, name, step if name == "step" else getattr(self, name))
        return moved


def requests_of(items: list, pieces: dict[str, Piece], budget: int,
                wires: dict[int, torch.dtype] | None = None, scratch: list[Scratch] = ()) -> list[Request]:
    """A target rank's requests, one per read item (in `items`' order, layer by layer), their
    `step` the window they fall in: windows of at most `budget` bytes as its messages pack
    them (a larger item alone), counting the host scratch alive in the window (`scratch`: a
    quantized target assembled from boxes that cut its blocks, `wire.AssembledDest`).
    `own_steps` turns windows into steps. `wires`: the items (by position) sent cast to a
    narrower dtype, or quantized (their bytes on the wire count)."""
    out, window, held, ends = [], 0, 0, {}
    starts: dict[int, list[Scratch]] = {}
    for s in scratch:
        starts.setdefault(s.first, []).append(s)
    alive: dict[str, Scratch] = {}  # scratch alive at this item, and alive in this window
    in_window: dict[str, Scratch] = {}
    scratch_bytes, wires = 0, wires or {}  # _bytes(in_window), summed again only when it changes
    for position, item in enumerate(items):
        for s in starts.get(position, ()):
            alive[s.target] = in_window[s.target] = s
            scratch_bytes = _bytes(in_window)
        key = item.entry.key
        request = Request(window, pieces[key].rank, key, item.src_box, item.entry.dtype, wires.get(position))
        source, nbytes = request.source, request.nbytes
        grow = packed_growth(ends.get(source, 0), nbytes, request.itemsize)
        if held and held + grow + scratch_bytes > budget:
            window, held, ends, grow, in_window = window + 1, 0, {}, nbytes, dict(alive)
            scratch_bytes = _bytes(in_window)
            request = request.at(window)
        if in_window and nbytes + scratch_bytes > budget:
            raise _scratch_error(item, nbytes, budget, in_window)
        held += grow
        ends[source] = ends.get(source, 0) + grow
        out.append(request)
        if alive:
            alive = {t: s for t, s in alive.items() if s.last != position}
    return out


def _bytes(scratch: dict[str, Scratch]) -> int:
    return sum(s.nbytes for s in scratch.values())


def _scratch_error(item, nbytes: int, budget: int, scratch: dict[str, Scratch]) -> PlanError:
    held = ", ".join(f"{s.target!r} ({s.nbytes} bytes)" for s in scratch.values())
    return PlanError(f"WeightSync: max_host_bytes={budget} is smaller than this rank's float32 scratch of {held} "
                     f"plus a box of {item.target!r} ({nbytes} bytes) received beside it: the trainer's shards cut "
                     "the scale groups or FP8 blocks of that scratch's tensor, so its boxes are assembled in full "
                     "precision and quantized once all have landed; raise max_host_bytes to at least "
                     f"{nbytes + _bytes(scratch)}.")


def packed_growth(end: int, nbytes: int, itemsize: int) -> int:
    """The bytes a box of `nbytes` adds to a message of `end` bytes (`packed_offsets`)."""
    return -(-end // itemsize) * itemsize + nbytes - end


@dataclass(frozen=True)
class Slot:
    """How many packed bytes a source rank sends one target rank per step: `each` in every
    step, `turn` in its turns (the steps k with k % `turns` == `at`)."""

    each: int
    turn: int = 0
    turns: int = 1
    at: int = 0

    def budget(self, step: int) -> int:
        return max(self.each, self.turn) if step % self.turns == self.at else self.each


def source_slots(needs: dict[int, int], budget: int) -> dict[int, Slot]:
    """A source rank's `max_host_bytes` shared among the target ranks that ask it (`needs`:
    target rank -> its largest request of it): in each step one of them, in turn, may take
    up to the largest request any asks, the others an even share of what is left (never more
    than the one in turn gets). In any step the targets served sum at most `budget`."""
    most, others = max(needs.values()), len(needs) - 1
    each = min(max(0, budget - most) // others, budget // len(needs)) if others else 0
    return {target: Slot(each, budget - others * each, len(needs), i) for i, target in enumerate(sorted(needs))}


def default_slots(target: int, requests: list[Request]) -> dict[int, Slot]:
    """A target rank's slot of each source rank it asks over the wire without a
    `max_host_bytes` there: every step, about one layer of what the pair moves, never less
    than its largest request (so that a source's default is about one layer of what it
    sends, summed over its targets, as a load's)."""
    largest = largest_requests(target, requests)  # then the largest layer, where larger
    layers: dict[tuple[int, str], int] = {}  # (source, layer) -> bytes
    named: dict[str, str] = {}  # tensor -> its layer, matched once (a tensor has a box per FSDP rank)
    for r in requests:
        if r.source == target:
            continue
        name = r.key.rpartition("@")[0]
        layer = named.get(name)
        if layer is None:
            layer = named[name] = layer_of(name)
        if layer:  # outside numbered layers (embeddings, head): only the largest request counts
            layers[r.source, layer] = layers.get((r.source, layer), 0) + r.nbytes
    for (source, _), nbytes in layers.items():
        largest[source] = max(largest[source], nbytes)
    return {source: Slot(b) for source, b in largest.items()}


def largest_requests(target: int, requests: list[Request]) -> dict[int, int]:
    """Source rank -> the largest request a target rank addresses to it over the wire."""
    out: dict[int, int] = {}
    for r in requests:
        if r.source != target:
            out[r.source] = max(out.get(r.source, 0), r.nbytes)
    return out


def own_steps(target: int, requests: list[Request], slots: dict[int, Slot]) -> list[Request]:
    """A target rank's requests with the steps it receives them at, from its own requests
    and its sources' slots alone (no other target's requests): step by step, from one window
    (`requests_of`: the target's budget) at a time, each request whose source's packed
    message stays within that step's slot (a source's later requests then wait for the next
    step). Its source learns each step from the requests it reads. A request larger than
    any step's slot is a PlanError."""
    for r in requests:
        slot = slots.get(r.source)
        if slot is not None and r.nbytes > max(slot.each, slot.turn):
            raise PlanError(f"WeightSync: {r.key} ({r.nbytes} bytes, rank {r.source} to rank {target}) exceeds rank "
                            f"{r.source}'s step budget for rank {target} ({max(slot.each, slot.turn)}): every rank "
                            "must run the same lazyload version.")
    out: list = [None] * len(requests)
    step, first = 0, 0
    while first < len(requests):
        window = requests[first].step
        last = next((i for i in range(first, len(requests)) if requests[i].step != window), len(requests))
        left = list(range(first, last))
        while left:  # a source's first request left fits its slot's turn with an empty message
            ends: dict[int, int] = {}  # source -> its message's bytes so far this step
            budgets: dict[int, int] = {}  # source -> its slot's bytes this step
            waiting = []
            for i in left:
                r = requests[i]
                source = r.source
                if source != target:
                    end = ends.get(source, 0)
                    if end >= 0:
                        end += packed_growth(end, r.nbytes, r.itemsize)
                        budget = budgets.get(source)
                        if budget is None:
                            budget = budgets[source] = slots[source].budget(step)
                    if end < 0 or end > budget:
                        ends[source] = -1  # this source's later requests keep their order: next step
                        waiting.append(i)
                        continue
                    ends[source] = end
                out[i] = r if r.step == step else r.at(step)
            left, step = waiting, step + 1
        first = last
    return out


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


@dataclass(frozen=True)
class Summary:
    """What a target rank tells every rank of its plan: the digest of its requests (their
    steps included) and its number of steps. A few bytes, whatever its requests."""

    digest: str
    steps: int


def routes_for(me: int, mine: list[Request] | None, asked: dict[int, tuple[str, list[Request]]],
               summaries: dict[int, Summary | None]) -> Routes:
    """This rank's routes: what it receives, from its own requests with their steps (`mine`;
    None on a rank that holds no target), and what it sends, from the requests each target
    rank addressed to it (`asked`: target rank -> (the digest that target computed of them,
    its requests of this rank in its order, with their steps)), each checked against that
    digest. `summaries`: every target's, for the number of steps and the plan's digest."""
    sends: dict[int, dict[int, list[Request]]] = {}
    receives: dict[int, dict[int, list[int]]] = {}
    local: dict[int, list[int]] = {}
    for target, (digest, requests) in sorted(asked.items()):
        if pair_digest(requests) != digest:
            raise PlanError(f"WeightSync: rank {me} read rank {target}'s requests of it, which do not match the digest "
                            f"rank {target} published (another lazyload version there, or a store that lost a write); "
                            "every rank must run the same lazyload version; no byte moved.")
        for request in requests:
            sends.setdefault(request.step, {}).setdefault(target, []).append(request)
    for position, request in enumerate(mine or ()):
        if request.source == me:
            local.setdefault(request.step, []).append(position)
        else:
            receives.setdefault(request.step, {}).setdefault(request.source, []).append(position)
    steps = max((s.steps for s in summaries.values() if s is not None), default=0)
    return Routes(steps, {s: {t: tuple(q) for t, q in by.items()} for s, by in sends.items()},
                  {s: {r: tuple(q) for r, q in by.items()} for s, by in receives.items()},
                  {s: tuple(q) for s, q in local.items()}, sync_digest(summaries))


def pair_digest(requests: list[Request]) -> str:
    """The digest of one target rank's requests of one source rank (or of all its requests)."""
    digest = hashlib.sha256()
    for r in requests:
        digest.update(_line(r))
    return digest.hexdigest()[:16]


def _line(r: Request) -> bytes:
    """What the digests hash of a request."""
    wire = f"\0{r.wire}" if r.wire is not None else ""  # both ends agree on the bytes sent
    return f"{r.step}\0{r.source}\0{r.key}\0{r.box}{wire}\n".encode()


def published(target: int, requests: list[Request]) -> tuple[dict[int, tuple[str, list[Request]]], Summary]:
    """What a target rank publishes of its requests with their steps: those of each source
    rank over the wire (by the rank they ask, each in the target's order; its own copies, a
    colocated rank's, go over no wire) with their `pair_digest`, and its `Summary` (the
    digest of all of them; its steps counted to the latest, a window's may come out of
    order); each request's line hashed into both at once (made once, not per digest)."""
    whole, pairs = hashlib.sha256(), {}
    for r in requests:
        line = _line(r)
        whole.update(line)
        if r.source != target:
            digest, asked = pairs.get(r.source) or pairs.setdefault(r.source, (hashlib.sha256(), []))
            digest.update(line)
            asked.append(r)
    return ({source: (digest.hexdigest()[:16], asked) for source, (digest, asked) in pairs.items()},
            Summary(whole.hexdigest()[:16], max((r.step for r in requests), default=-1) + 1))


def sync_digest(summaries: dict[int, Summary | None]) -> str:
    """The digest of the whole sync plan: every target rank's (its requests' digest, steps
    included, and its number of steps); every rank computes it from the same summaries."""
    digest = hashlib.sha256()
    for target, summary in sorted((r, s) for r, s in summaries.items() if s is not None):
        digest.update(f"{target}\0{summary.digest}\0{summary.steps}\n".encode())
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
