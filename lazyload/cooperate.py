"""Replicas that read the same bytes read them once: the ranks of a (dp, tp) mesh with the
same `tp` coordinate hold the same shard, so their plans have the same read items. They
split those items target by target, balanced by bytes layer by layer (every rank computes
the same split from its plan), each reads its part from storage into its destinations,
and once every rank has read its part (the agreement's "read" point) each layer's
targets are broadcast from their reader over the `dp` process group, straight into the
destinations (torch.distributed collectives: gloo on CPU, NCCL on GPU).

A target is the unit: whatever its destination holds once read (a plain tensor, 8-bit data
and scales, the result of a conversion) is what is broadcast, so every destination kind
cooperates without knowing it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .placer import Destination
from .schedule import Group


@dataclass(frozen=True)
class Share:
    """This rank's part of the reads its replicas split: `readers` maps each target to the
    `dp` coordinate that reads it; `me` is this rank's; `dp` the replica mesh."""

    readers: dict[str, int]
    me: int
    dp: Any

    def own(self, groups: list[Group]) -> list[Group]:
        """The groups, each with the items of the targets this rank reads (empty ones dropped)."""
        return [Group(g.layer, kept) for g in groups
                if (kept := tuple(i for i in g.items if self.readers[i.target] == self.me))]


def split_reads(groups: list[Group], replicas: int) -> dict[str, int]:
    """Each target's reader among `replicas` ranks: layer by layer, the largest targets first,
    each to the rank that has the fewest bytes so far (counted over the whole load)."""
    totals = [0] * replicas
    readers: dict[str, int] = {}
    for group in groups:
        nbytes: dict[str, int] = {}
        for item in group.items:
            nbytes[item.target] = nbytes.get(item.target, 0) + item.nbytes
        for name in sorted(nbytes, key=lambda n: (-nbytes[n], n)):
            reader = min(range(replicas), key=lambda r: (totals[r], r))
            readers[name] = reader
            totals[reader] += nbytes[name]
    return readers


def share_of(groups: list[Group], dp: Any) -> Share:
    """This rank's Share of `groups` (its plan's) among the ranks of the replica mesh `dp`."""
    return Share(split_reads(groups, dp.size()), dp.get_local_rank(), dp)


def exchange(groups: list[Group], share: Share, dests: dict[str, Destination]) -> int:
    """Broadcast every target from its reader to the other replicas, one layer at a time
    (its broadcasts in flight together); returns the bytes this rank received."""
    group = share.dp.get_group()
    received = 0
    for layer in groups:
        pending = []
        for name in dict.fromkeys(item.target for item in layer.items):
            source = share.readers[name]
            for tensor in dests[name].tensors(name).values():
                pending.append(_broadcast(tensor, source, group))
                received += tensor.nbytes if source != share.me else 0
        for work, staged, tensor in pending:
            work.wait()
            if staged is not tensor:
                tensor.copy_(staged)
    return received


def _broadcast(tensor: torch.Tensor, source: int, group: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Start broadcasting `tensor`'s bytes from the group's rank `source`, as bytes (exact for
    every dtype, float8 included); a tensor that is not contiguous goes through a contiguous copy."""
    import torch.distributed as dist

    staged = tensor if tensor.is_contiguous() else tensor.contiguous()
    as_bytes = staged.reshape(-1).view(torch.uint8)
    return dist.broadcast(as_bytes, group=group, group_src=source, async_op=True), staged, tensor
