"""The sync plan: which boxes move between which ranks, and when, computed once from
metadata (each target rank's read items, as requests it addresses to each source rank: a
source reads only the requests of it, every rank a short summary of each target's). A target rank's items
are cut, in layer order, into steps of at most its byte budget; at step k every rank posts
all its sends and receives of step k, then waits for them, so that no pair can deadlock and
a target holds at most one step's bytes in flight."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..errors import PlanError
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


def routes_for(me: int, mine: list[Request] | None, asked: dict[int, list[Request]],
               summaries: dict[int, Summary | None]) -> Routes:
    """This rank's routes: what it receives, from its own requests (`mine`; None on a rank
    that holds no target), and what it sends, from the requests each target rank addressed
    to it (`asked`: target rank -> its requests of this rank, in its order), each checked
    against the digest its target published (`summaries`: every rank's `Summary`)."""
    sends: dict[int, dict[int, list[Request]]] = {}
    receives: dict[int, dict[int, list[int]]] = {}
    local: dict[int, list[int]] = {}
    for target, requests in sorted(asked.items()):
        if pair_digest(requests) != summaries[target].pairs.get(me):
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


@dataclass(frozen=True)
class Summary:
    """What a target rank tells every rank of its requests: its steps and, per source rank it
    asks, the digest of the requests addressed to that source (kept under a key of the pair)."""

    steps: int
    pairs: dict[int, str]

    @classmethod
    def of(cls, by_source: dict[int, list[Request]]) -> "Summary":
        steps = max((r.step + 1 for requests in by_source.values() for r in requests), default=0)
        return cls(steps, {source: pair_digest(requests) for source, requests in sorted(by_source.items())})


def addressed(requests: list[Request]) -> dict[int, list[Request]]:
    """A target rank's requests by the source rank they ask (each in the target's order)."""
    out: dict[int, list[Request]] = {}
    for request in requests:
        out.setdefault(request.source, []).append(request)
    return out


def pair_digest(requests: list[Request]) -> str:
    """The digest of one target rank's requests of one source rank."""
    digest = hashlib.sha256()
    for r in requests:
        digest.update(f"{r.step}\0{r.source}\0{r.key}\0{r.box}\n".encode())
    return digest.hexdigest()[:16]


def sync_digest(summaries: dict[int, Summary | None]) -> str:
    """The digest of the whole sync plan: of every target rank's requests, by their pairs'
    digests; every rank computes it from the same published summaries."""
    digest = hashlib.sha256()
    for target, summary in sorted((r, s) for r, s in summaries.items() if s is not None):
        for source, pair in summary.pairs.items():
            digest.update(f"{target}\0{source}\0{pair}\n".encode())
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
