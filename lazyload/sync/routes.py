"""The sync plan: which boxes move between which ranks, and when, computed once from
metadata (every target rank's read items, exchanged at construction). Each rank has a byte
budget per step (its `max_host_bytes`, default about one layer of its traffic), on each
side: a target holds at most that of received messages and local copies, a source at most
that of packed messages, summed over the targets it sends to. Every rank computes the same
steps from the same requests (`in_steps`); at step k every rank posts all its sends and
receives of step k, then waits for them, so that no pair can deadlock."""
from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import PlanError
from ..expr import Box, box_numel, box_shape
from ..schedule import layer_of
from .source_index import Piece


@dataclass(frozen=True)
class Request:
    """A target rank asks source rank `source` for `box` of the piece stored as `key`, at `step`."""

    step: int
    source: int
    key: str
    box: Box
    itemsize: int  # of the stored key's dtype

    @property
    def nbytes(self) -> int:
        return box_numel(self.box) * self.itemsize


def requests_of(items: list, pieces: dict[str, Piece]) -> list[Request]:
    """A target rank's requests, one per read item (in `items`' order, layer by layer), at
    step 0: every rank assigns the steps of all of them (`in_steps`)."""
    return [Request(0, pieces[item.entry.key].rank, item.entry.key, item.src_box, item.entry.itemsize)
            for item in items]


def step_budgets(queues: dict[int, list[Request]], sizes: dict[int, list[int]],
                 max_host_bytes: dict[int, int | None]) -> tuple[dict[int, int], dict[int, int]]:
    """Each rank's bytes per step as a target (messages received and local copies) and as a
    source (messages packed), from every target's requests and their `sizes`: its
    `max_host_bytes`, else about one layer of that side's requests, never less than its
    largest one (as a load's default budget)."""
    receiving: dict[int, int] = {}
    sending: dict[int, int] = {}  # source -> its largest request, then its largest layer
    sent: dict[tuple[int, str], int] = {}  # (source, layer) -> bytes
    layers: dict[str, str] = {}  # stored key -> its tensor's layer
    for target, requests in queues.items():
        received: dict[str, int] = {}
        for r, nbytes in zip(requests, sizes[target]):
            layer = layers.get(r.key)
            if layer is None:
                layer = layers[r.key] = layer_of(r.key.rpartition("@")[0])
            received[layer] = received.get(layer, 0) + nbytes
            if r.source != target:
                sent[r.source, layer] = sent.get((r.source, layer), 0) + nbytes
                sending[r.source] = max(sending.get(r.source, 0), nbytes)
        received.pop("", None)  # outside numbered layers (embeddings, head): only the largest request counts
        receiving[target] = max(max(sizes[target]), *received.values(), 0)
    for (source, layer), nbytes in sent.items():
        if layer:
            sending[source] = max(sending[source], nbytes)
    return ({r: max_host_bytes.get(r) or b for r, b in receiving.items()},
            {r: max_host_bytes.get(r) or b for r, b in sending.items()})


def in_steps(wanted: dict[int, list[Request] | None],
             max_host_bytes: dict[int, int | None]) -> dict[int, list[Request] | None]:
    """`wanted` with every request's step. Step by step, the target ranks take their next
    request in turn (one each round, each in its own order, the first turn rotating), while the
    step's bytes of that target and of the request's source stay within their budgets
    (`step_budgets`; a message's bytes as packed, alignment included): a source's budget is
    shared by the targets it serves. A target whose next request does not fit waits for the
    next step. No request exceeds a budget (targets cut larger items): each step takes one."""
    queues = {t: q for t, q in sorted(wanted.items()) if q}
    sizes = {t: [r.nbytes for r in q] for t, q in queues.items()}
    receiving, sending = step_budgets(queues, sizes, max_host_bytes)
    taken = dict.fromkeys(queues, 0)
    out: dict[int, list[Request]] = {t: [] for t in queues}
    step, active = 0, list(queues)
    while active:
        held: dict[int, int] = {}  # target -> bytes received and copied this step
        packed: dict[int, int] = {}  # source -> bytes of its messages this step
        ends: dict[tuple[int, int], int] = {}  # (source, target) -> their message's bytes so far
        first = step % len(active)  # each step's first turn to the next target: a source's budget is shared fairly
        turns = deque(active[first:] + active[:first])  # the targets that may still take a request this step
        while turns:
            target = turns.popleft()
            i = taken[target]
            r = queues[target][i]
            remote = r.source != target
            end = ends.get((r.source, target), 0) if remote else 0
            grow = -(-end // r.itemsize) * r.itemsize + sizes[target][i] - end  # packed_offsets' alignment
            if (held.get(target, 0) + grow > receiving[target]
                    or remote and packed.get(r.source, 0) + grow > sending[r.source]):
                continue
            held[target] = held.get(target, 0) + grow
            if remote:
                packed[r.source], ends[r.source, target] = packed.get(r.source, 0) + grow, end + grow
            out[target].append(Request(step, r.source, r.key, r.box, r.itemsize))
            taken[target] = i + 1
            if i + 1 < len(queues[target]):
                turns.append(target)
        if not held:
            t = active[first]
            r = queues[t][taken[t]]
            raise PlanError(f"WeightSync: {r.key} ({r.nbytes} bytes, rank {r.source} to rank {t}) exceeds the step "
                            f"budget of rank {t} ({receiving[t]}) or of rank {r.source} ({sending.get(r.source)}): "
                            "every rank must run the same lazyload version.")
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
            digest.update(f"{target}\0{r.step}\0{r.source}\0{r.key}\0{r.box}\n".encode())
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
