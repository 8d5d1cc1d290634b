"""Which copy of a replicated box each target rank receives. A box several source ranks
hold (a tensor FSDP or TP leaves replicated: the norms and embeddings at a 2-D FSDP x TP
trainer) is one copy per holder; the planner picked one by position (`Layout.expr`, right
for a checkpoint's files, not for a sync), and the choice is made again here, by each
target rank for its requests, so that:

- a target rank receives from as few source ranks per step as the boxes' holders allow
  (one message per source and step): its own copy first (no wire), then a source it
  receives other boxes from in that step anyway (the trainer ranks of its TP coordinate),
  and only then a new one (the holder of most of the boxes still without a source);
- target ranks asking for the same box spread over the holders left to choose from: each
  takes them in a rotation by its rank (replicas' ranks differ, so their choices do).

Each target rank chooses from its own requests alone, before it publishes them (no rank
sees the others' requests: each source rank reads only those addressed to it). Only the
requests change: a target rank's read items keep the planner's
key, which names a piece with the same box as the copy chosen (what it receives is placed
by position; a colocated rank's own copy is read at the same place of its own tensor)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import groupby

from .routes import Request
from .source_index import Piece, copies_of


def choose_copies(wanted: dict[int, list[Request] | None], pieces: dict[str, Piece],
                  copies: dict[str, tuple[str, dict[int, str]]] | None = None) -> dict[int, list[Request] | None]:
    """`wanted` (global rank -> its requests) with each request of a replicated box sent to
    the copy chosen as the module docstring says. Each target rank's choice depends on its
    own requests alone: a target chooses at construction without the others' requests."""
    copies = copies_of(pieces) if copies is None else copies  # `copies_of`, when the caller has it
    out: dict[int, list[Request] | None] = {}
    for target, requests in wanted.items():
        if not requests or not copies:
            out[target] = requests
            continue
        out[target] = [chosen for _, step in groupby(requests, key=lambda r: r.step)
                       for chosen in _step(target, list(step), copies)]
    return out


def _spread(target: int, ranks: set[int]) -> int:
    """One of `ranks`, rotated by the target rank: replicas (consecutive target ranks asking
    for the same boxes) take different holders."""
    ordered = sorted(ranks)
    return ordered[target % len(ordered)]


def _step(target: int, requests: list[Request], copies: dict) -> list[Request]:
    """One step of a target rank's requests, each replicated box's source chosen."""
    replicated = {i: copies[r.key] for i, r in enumerate(requests) if r.key in copies}
    if not replicated:
        return requests
    sources = {target} | {r.source for i, r in enumerate(requests) if i not in replicated}
    uncovered = [c for c in replicated.values() if not sources.intersection(c[1])]
    while uncovered:  # greedy cover: a holder of most boxes still without a source
        count = Counter(rank for _, held in uncovered for rank in held)
        most = max(count.values())
        best = _spread(target, {rank for rank, n in count.items() if n == most})
        sources.add(best)
        uncovered = [c for c in uncovered if best not in c[1]]
    out = list(requests)
    for i, (box, held) in replicated.items():
        request = requests[i]
        source = target if target in held else _spread(target, sources.intersection(held))
        if source != request.source:
            out[i] = replace(request, source=source, key=held[source])
    return out
