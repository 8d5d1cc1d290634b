"""The ranks of a sync and how its messages reach them.

Two kinds of group: one torch.distributed knows (the default group, or one of `new_group`:
global ranks, point-to-point through `batch_isend_irecv`), and a process group made apart
from torch's world, `ProcessGroupGloo(store, rank, size)` (or NCCL's): what an RL framework
makes between trainer processes and an inference engine's workers, which each have a
default group of their own (vLLM's). Its ranks are 0..size-1 and it sends and receives
itself; the sync then needs that group's store, passed in (`WeightSync(store=...)`).

Under NCCL the sync's messages travel on a communicator of the sync's own (`NcclLink`),
never on `group` itself: NCCL ignores tags and pairs each peer's sends and receives by
order, so a failed sync's leftovers would pair with the retry's; the only way to drop them
is to abort the communicator that holds them, which must not be the caller's."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch

from ..agreement import CollectiveError
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
            # gloo (NCCL: NcclLink): op by op, each matched by its tag
            return dist.batch_isend_irecv(ops) if ops else []
        return ([self.group.send([buffer], peer, tag) for buffer, peer in sends]
                + [self.group.recv([buffer], peer, tag) for buffer, peer in receives])


@dataclass
class NcclLink:
    """The point-to-point messages of a sync over NCCL, on a communicator of its own: a
    `ProcessGroupNCCL` over the sync's store, under a key prefix of its own per generation
    (the failures so far, counted alike on every rank), so that no store key and no message
    of an aborted one is ever seen by the next. After a failure every rank aborts it (local:
    NCCL's abort also ends kernels stuck on a dead peer, which the caller's stream waits
    for); the next sync connects a fresh one. Messages pair by order on it (tags ignored)."""

    peers: Peers
    store: Any
    prefix: str  # the sync's store namespace
    timeout: float
    backend = "nccl"
    comm: Any = None  # the open communicator, None before the first sync and after a failure
    aborted: list = field(default_factory=list)  # kept alive: their works may still hold buffers

    def __post_init__(self) -> None:
        self.position = {rank: i for i, rank in enumerate(self.peers.ranks)}  # peer -> rank in the communicator

    def connect(self, generation: int, aborted: Callable[[], str | None], probe: torch.Tensor) -> list:
        """A fresh communicator once every rank is here (through the store, bounded by the
        timeout and watched for another rank's failure: NCCL's set-up blocks the host until
        every rank joins); its first call, posted: an all-reduce of `probe` (one byte on the
        device) that every rank joins. torch leaves a batch of point-to-point calls undefined
        when it is a group's first and some rank has none; after a collective, any subset may
        send, so a step where a rank has nothing to send or receive posts nothing."""
        import torch.distributed as dist

        key = f"{self.prefix}/nccl{generation}"
        self._rendezvous(key, aborted)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=self.timeout + 60)  # its watchdog fires after the sync gave up
        self.comm = dist.ProcessGroupNCCL(dist.PrefixStore(f"{key}/comm", self.store), self.position[self.peers.rank],
                                          len(self.peers.ranks), options)
        return [self.comm.allreduce([probe])]

    def _rendezvous(self, key: str, aborted: Callable[[], str | None]) -> None:
        if self.store.add(f"{key}/arrived", 1) == len(self.peers.ranks):
            self.store.set(f"{key}/all", "1")
        deadline = time.monotonic() + self.timeout
        while not _set_within(self.store, f"{key}/all", 0.1):
            if time.monotonic() > deadline:
                raise CollectiveError(f"setting up the weight sync's NCCL communicator: not every rank arrived "
                                      f"within {self.timeout:g} s")
            if (reason := aborted()) is not None:
                raise CollectiveError(f"setting up the weight sync's NCCL communicator stopped: {reason}")

    def post(self, sends: list, receives: list, tag: int) -> list:
        """One step's sends and receives as one NCCL group (a pair sending both ways cannot
        deadlock), paired by order with the peer's; its one work. `tag` is ignored (NCCL's)."""
        if not (sends or receives):
            return []
        self.comm._start_coalescing()
        try:
            for buffer, peer in sends:
                self.comm.send([buffer], self.position[peer], 0)
            for buffer, peer in receives:
                self.comm.recv([buffer], self.position[peer], 0)
        finally:
            work = self.comm._end_coalescing()
        return [work]

    def abort(self) -> None:
        """Drop the communicator and whatever is pending on it (this rank's side)."""
        if self.comm is not None:
            self.aborted.append(self.comm)
            self.comm, comm = None, self.comm
            comm.abort()


def _set_within(store: Any, key: str, seconds: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=seconds))
        return True
    except Exception:  # the store's timeout (its error type differs between stores)
        return bool(store.check([key]))


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
