"""The ranks of a sync and how its messages reach them.

Two kinds of group: one torch.distributed knows (the default group, or one of `new_group`:
global ranks, point-to-point through `batch_isend_irecv`), and a process group made apart
from torch's world, `ProcessGroupGloo(store, rank, size)` (or NCCL's): what an RL framework
makes between trainer processes and an inference engine's workers, which each have a
default group of their own (vLLM's). Its ranks are 0..size-1 and it sends and receives
itself; the sync then needs that group's store, passed in (`WeightSync(store=...)`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ArgumentError


@dataclass(frozen=True)
class Peers:
    group: Any
    rank: int  # this process, in the numbering of `ranks`
    ranks: tuple[int, ...]
    backend: str  # "gloo" or "nccl"
    registered: bool  # a group of torch.distributed's world (else its own process group)

    @classmethod
    def of(cls, group: Any) -> "Peers":
        import torch.distributed as dist

        if group is not None and not _registered(group):
            if not all(hasattr(group, verb) for verb in ("rank", "size", "send", "recv")):
                raise ArgumentError(f"WeightSync(group=...) takes a torch.distributed process group, got "
                                    f"{type(group).__name__}.")
            return cls(group, group.rank(), tuple(range(group.size())), group.name(), False)
        if not (dist.is_available() and dist.is_initialized()):
            raise ArgumentError("WeightSync runs over torch.distributed: call init_process_group first (every "
                                "trainer and server rank constructs it), or pass a process group of its own "
                                "(group=ProcessGroupGloo(store, rank, size)) and its store (store=).")
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return cls(group, dist.get_rank(), tuple(sorted(ranks)), dist.get_backend(group), True)

    def default_store(self) -> Any:
        """The store of torch's default group: where a registered group's sync meets."""
        if not self.registered:
            raise ArgumentError("WeightSync(group=...) over a process group of its own needs store=, the store "
                                "that group was made with (e.g. the TCPStore of ProcessGroupGloo(store, rank, size)).")
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()

    def post(self, sends: list, receives: list, tag: int) -> list:
        """Start every (buffer, peer) send and receive of one step; their works, to wait for."""
        if self.registered:
            import torch.distributed as dist

            ops = ([dist.P2POp(dist.isend, buffer, peer, self.group, tag) for buffer, peer in sends]
                   + [dist.P2POp(dist.irecv, buffer, peer, self.group, tag) for buffer, peer in receives])
            # one batch: NCCL runs it as one group (a pair sending both ways cannot deadlock); gloo op by op
            return dist.batch_isend_irecv(ops) if ops else []
        return ([self.group.send([buffer], peer, tag) for buffer, peer in sends]
                + [self.group.recv([buffer], peer, tag) for buffer, peer in receives])


def _registered(group: Any) -> bool:
    """`group` is one of torch.distributed's world (`new_group`, the default group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True
