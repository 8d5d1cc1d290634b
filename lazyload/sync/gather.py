"""Metadata every rank of a sync shares once, at construction: through the default process
group's key-value store (no collective, so a rank that failed cannot block it), each wait
bounded by `rank_timeout`. A rank that fails publishes its error instead of its data, and
every rank then raises: the rank itself its own error, the others a RankFailedError naming it."""
from __future__ import annotations

import hashlib
import itertools
import pickle
from datetime import timedelta
from typing import Any, Callable

from ..errors import RankFailedError

# Constructions are numbered per group of ranks: every rank of a group constructs that group's
# WeightSyncs in the same order, while a rank in several groups (a trainer serving two replica
# groups) counts each group apart, so the numbers (store keys, message tags) agree in every group.
_constructions: dict[tuple[int, ...], itertools.count] = {}


def construction(ranks: list[int]) -> tuple[str, int]:
    """(store namespace, number) of the next WeightSync over `ranks` on this process."""
    key = tuple(ranks)
    number = next(_constructions.setdefault(key, itertools.count()))
    group = hashlib.sha256(",".join(map(str, key)).encode()).hexdigest()[:16]
    return f"lazyload/sync/{group}/{number}", number


class Gather:
    """All-gathers of small Python values over `ranks` (global ranks, this one `rank`)."""

    def __init__(self, store: Any, rank: int, ranks: list[int], timeout: float, prefix: str):
        self.store, self.rank, self.ranks, self.timeout, self.prefix = store, rank, ranks, timeout, prefix

    def run(self, stage: str, compute: Callable[[], Any]) -> dict[int, Any]:
        """`compute()` on this rank, then every rank's value (global rank -> value). An
        exception of `compute` is told to the others, then raised here; another rank's
        failure (or silence past the timeout) is a RankFailedError naming it."""
        try:
            value, error = compute(), None
        except Exception as exc:
            value, error = None, exc
        self.store.set(self._key(stage, self.rank), pickle.dumps(
            ("ok", value) if error is None else ("error", f"{type(error).__name__}: {error}")))
        if error is not None:
            raise error
        values = self._collect(stage)
        failed = {r: v[1] for r, v in values.items() if v[0] == "error"}
        if failed:
            listed = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            raise RankFailedError(f"rank {self.rank}: WeightSync failed at '{stage}' on {len(failed)} rank(s) "
                                  f"({listed}); no byte moved. Fix that rank's error and construct again on every "
                                  "rank.", failed)
        return {r: v[1] for r, v in values.items()}

    def exchange(self, stage: str, compute: Callable[[], tuple[dict[int, Any], Any] | None]) -> tuple[dict, dict]:
        """Values addressed rank to rank: `compute()` on this rank gives (peer -> value, a
        summary, or None); each value goes under a key of its pair, and only its peer reads
        it (then deletes it), while every rank reads every rank's summary and the peers it
        addressed, as `run` does. Returns (rank -> summary, rank -> its value to this rank):
        a rank's store traffic is its own values and the summaries, not the whole job's."""
        def publish() -> tuple[tuple[int, ...], Any] | None:
            computed = compute()
            if computed is None:
                return None
            values, summary = computed
            for peer, value in values.items():
                self.store.set(self._key(stage, f"{self.rank}>{peer}"), pickle.dumps(value))
            return tuple(values), summary

        published = self.run(stage, publish)
        mine = {}
        for rank, value in sorted(published.items()):
            if value is not None and self.rank in value[0]:
                key = self._key(stage, f"{rank}>{self.rank}")
                mine[rank] = pickle.loads(self.store.get(key))
                self.store.delete_key(key)
        return {r: v if v is None else v[1] for r, v in published.items()}, mine

    def close(self, stages: tuple[str, ...]) -> None:
        """This rank read every value of `stages`; the last rank to say so deletes them, so
        that a long job constructing many WeightSyncs does not grow the store (no rank waits:
        whoever counts last knows every other rank has read already)."""
        if self.store.add(f"{self.prefix}/read", 1) < len(self.ranks):
            return
        for key in [self._key(stage, r) for stage in stages for r in self.ranks] + [f"{self.prefix}/read"]:
            self.store.delete_key(key)

    def _key(self, stage: str, rank: int | str) -> str:
        return f"{self.prefix}/{stage}/{rank}"

    def _collect(self, stage: str) -> dict[int, tuple]:
        keys = [self._key(stage, r) for r in self.ranks]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as exc:
            missing = [r for r, k in zip(self.ranks, keys) if not self._has(k)]
            raise RankFailedError(f"rank {self.rank}: WeightSync waited {self.timeout:g} s at '{stage}' for rank(s) "
                                  f"{', '.join(map(str, missing))}, which did not report (stopped, or not constructing "
                                  "the same WeightSync); no byte moved.",
                                  {r: "did not report" for r in missing}) from exc
        return {r: pickle.loads(self.store.get(k)) for r, k in zip(self.ranks, keys)}

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False
