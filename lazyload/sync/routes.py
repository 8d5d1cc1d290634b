"""The sync plan: which boxes move between which ranks, and when, computed once from
metadata (every target rank's read items, exchanged at construction). A target rank's items
are cut, in layer order, into steps of at most its byte budget; at step k every rank posts
all its sends and receives of step k, then waits for them, so that no pair can deadlock and
a target holds at most one step's bytes in flight."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..expr import Box, box_numel, box_shape
from .source_index import Piece


@dataclass(frozen=True)
class Request:
    """A target rank asks source rank `source` for `box` of the piece stored as `key`, at `step`."""

    step: int
    source: int
    key: str
    box: Box


def requests_of(items: list, pieces: dict[str, Piece], budget: int) -> list[Request]:
    """A target rank's requests, one per read item (in `items`' order, layer by layer): steps
    of at most `budget` bytes (a larger item alone)."""
    out, step, held = [], 0, 0
    for item in items:
        nbytes = item.nbytes
        if held and held + nbytes > budget:
            step, held = step + 1, 0
        held += nbytes
        out.append(Request(step, pieces[item.entry.key].rank, item.entry.key, item.src_box))
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


def routes_for(me: int, wanted: dict[int, list[Request] | None]) -> Routes:
    """This rank's routes, from every target rank's requests (`wanted`: global rank -> its
    requests, None for a rank that holds no target)."""
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
