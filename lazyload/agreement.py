"""Rank agreement: the ranks of a torch.distributed load tell each other whether they got
past each stage, so that one rank's failure reaches every other one within a bounded
time, instead of leaving them waiting forever in the next collective.

Through the default process group's key-value store (no collective: a rank that failed
or died cannot block it): at each point every rank sets `lazyload/<load>/<point>/rank<r>`
to "ok" or its error, then waits (at most `timeout` seconds) for all the others. Loads are
numbered per process: every rank of a job calls `load_into` the same number of times, as
with any collective. A rank that fails publishes its error at the next point and waits
there too (bounded), so that the store (hosted by rank 0) outlives the others' reads.
"""
from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta
from typing import Any

from .errors import RankFailedError

logger = logging.getLogger("lazyload")
_loads = itertools.count()
POLL = 0.01  # seconds between the looks of a failed rank at how many others have read its error
# Where ranks agree: input checked and planned, before the model changes (or any byte is
# read); everything read, before the model is made runnable (tensors assigned).
POINTS = ("planned", "read")


class Agreement:
    """The points of one load at which ranks agree; `NoAgreement` outside a process group."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float, ranks: list[int] | None = None):
        """`ranks`: the global ranks of the load (a device mesh's), `rank` being this process's;
        default all `world` ranks of the process group."""
        self.store, self.rank, self.timeout = store, rank, timeout
        self.ranks = list(range(world)) if ranks is None else ranks
        self.world = len(self.ranks)
        # a mesh's loads are numbered apart from other meshes' (disjoint groups of one job)
        self.prefix = f"lazyload/{next(_loads)}" + ("" if ranks is None else f"@{self.ranks[0]}")
        self.passed = 0  # points of POINTS passed
        self.settled = False  # a point already told everyone the outcome

    def reached(self, point: str, seconds: float | None = None) -> None:
        """This rank got to `point` (the next of POINTS); returns once every rank did, or
        raises RankFailedError naming the ranks that failed and their errors. `seconds`: how
        long this rank took to get there; the first rank logs the slowest one."""
        assert point == POINTS[self.passed], f"agreement points out of order: {point}"
        if seconds is not None:  # set before "ok": a rank that reads every "ok" finds every time
            self.store.set(f"{self.prefix}/{point}/seconds{self.rank}", f"{seconds:.6f}")
        failed = self._exchange(point, "ok")
        self.passed += 1
        if failed:
            self.settled = True
            raise RankFailedError(_message(self.rank, point, failed), failed)
        if seconds is not None and self.rank == self.ranks[0]:
            self._log_slowest(point)

    def _log_slowest(self, point: str) -> None:
        """Log the slowest rank to `point` and how far behind the fastest it was (the skew
        users see as "some ranks take much longer")."""
        values = self.store.multi_get([f"{self.prefix}/{point}/seconds{r}" for r in self.ranks])
        took = {r: float(v.decode()) for r, v in zip(self.ranks, values)}
        slow, fast = max(took, key=took.get), min(took, key=took.get)
        logger.info("lazyload: rank %d was the slowest to '%s': %.2f s, %.2f s behind the fastest (rank %d, %.2f s)",
                    slow, point, took[slow], took[slow] - took[fast], fast, took[fast])

    def failed(self, exc: BaseException) -> None:
        """This rank failed: tell the others at the next point (and wait, bounded, for them
        to read it). Nothing to tell once past the last point, or once settled."""
        if not self.settled and self.passed < len(POINTS):
            self.settled = True
            self._exchange(POINTS[self.passed], f"{type(exc).__name__}: {exc}"[:4000])

    def _exchange(self, point: str, mine: str) -> dict[int, str]:
        keys = {r: f"{self.prefix}/{point}/rank{r}" for r in self.ranks}
        self.store.set(keys[self.rank], mine)
        deadline = time.monotonic() + self.timeout
        late = self._wait(keys, deadline)
        failed = {r: "did not report within {:g} s (it crashed, hangs, or did not call load_into)".format(
            self.timeout) for r in late}
        present = [r for r in self.ranks if r not in late]
        for r, value in zip(present, self.store.multi_get([keys[r] for r in present])):  # one request
            if r != self.rank and value.decode() != "ok":
                failed[r] = value.decode()
        if failed or mine != "ok":  # keep the store's host alive until every rank has read
            self.store.add(f"{self.prefix}/{point}/read", 1)
            self._wait_count(f"{self.prefix}/{point}/read", self.world - len(late), deadline)
        return dict(sorted(failed.items()))

    def _wait(self, keys: dict[int, str], deadline: float) -> set[int]:
        """Ranks whose key is still missing at the deadline."""
        try:
            self.store.wait(list(keys.values()), timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            return set()
        except Exception:  # the store's timeout (its error type differs between stores)
            return {r for r, key in keys.items() if not self.store.check([key])}

    def _wait_count(self, key: str, count: int, deadline: float) -> None:
        while int(self.store.add(key, 0)) < count and time.monotonic() < deadline:
            time.sleep(POLL)


class NoAgreement:
    """A load outside a process group (or not this group's rank and world): nothing to agree."""

    settled = True

    def reached(self, point: str, seconds: float | None = None) -> None:
        pass

    def failed(self, exc: BaseException) -> None:
        pass


def agreement(rank: int, world: int, timeout: float, mesh: Any = None) -> Agreement | NoAgreement:
    """An Agreement when torch.distributed is initialised and (rank, world) > 1 are its, or
    over every rank of `mesh` (a DeviceMesh of more than one rank: all replicas agree)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return NoAgreement()
    from torch.distributed.distributed_c10d import _get_default_store

    if mesh is not None:
        ranks = sorted(mesh.mesh.flatten().tolist())
        if len(ranks) <= 1:
            return NoAgreement()
        return Agreement(_get_default_store(), dist.get_rank(), len(ranks), timeout, ranks)
    if world <= 1 or (dist.get_rank(), dist.get_world_size()) != (rank, world):
        return NoAgreement()
    return Agreement(_get_default_store(), rank, world, timeout)


def _message(rank: int, point: str, failed: dict[int, str]) -> str:
    what = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
    return (f"rank {rank}: the load failed on {len(failed)} other rank(s) before '{point}' ({what}); this rank "
            "stopped before making its model runnable. Fix the failing rank's error and re-run every rank.")
