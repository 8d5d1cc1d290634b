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

    def put(self, stage: str, value: Any, name: str | None = None) -> None:
        """A value of this rank at `stage`, read only by the ranks that need it (`read`),
        published before this rank's `run` of the stage (so that its `run` value, once
        read, says it is there). `name`: a value several ranks share, under its name
        (`read_named`; one rank puts it)."""
        self.store.set(self._key(stage, name or f"{self.rank}.put"), pickle.dumps(value))

    def read_named(self, stage: str, name: str) -> Any | None:
        """The value put under `name` at `stage` (after its `run`), None where none was."""
        key = self._key(stage, name)
        return pickle.loads(self.store.get(key)) if self._has(key) else None

    def read(self, stage: str, ranks: list[int]) -> dict[int, Any]:
        """The values `ranks` `put` at `stage` (after a `run` of that stage that read them ok)."""
        return {r: pickle.loads(self.store.get(self._key(stage, f"{r}.put"))) for r in ranks}

    def ask(self, stage: str, needs: dict[int, int]) -> None:
        """Tell each peer of `needs` that this rank will address it a value at `stage`
        (`exchange`), with a number (its largest request there): a counter per peer
        (`store.add`), and this rank's number and need under the count it got."""
        for peer, need in needs.items():
            count = self.store.add(self._key(stage, f"{peer}#"), 1)
            self.store.set(self._key(stage, f"{peer}#{count}"), f"{self.rank} {need}")

    def asked_by(self, stage: str) -> dict[int, int]:
        """The ranks that asked this one at `stage`, with their needs (once every rank has
        asked: after a `run` of a stage it asked before): its own counter's entries alone."""
        count = self.store.add(self._key(stage, f"{self.rank}#"), 0)
        asked = (self.store.get(self._key(stage, f"{self.rank}#{i}")).split() for i in range(1, count + 1))
        return dict(sorted((int(rank), int(need)) for rank, need in asked))

    def tell(self, stage: str, values: dict[int, Any]) -> None:
        """A value for each peer of `values`, read by it alone (`told`)."""
        for peer, value in values.items():
            self.store.set(self._key(stage, f"{self.rank}>{peer}"), pickle.dumps(value))

    def told(self, stage: str, peers: list[int]) -> dict[int, Any]:
        """What each of `peers` told this rank at `stage` (waiting for it up to the timeout;
        read once, then deleted)."""
        keys = {peer: self._key(stage, f"{peer}>{self.rank}") for peer in peers}
        try:
            self.store.wait(list(keys.values()), timedelta(seconds=self.timeout))
        except Exception as exc:
            missing = [peer for peer, key in keys.items() if not self._has(key)]
            raise RankFailedError(f"rank {self.rank}: WeightSync waited {self.timeout:g} s at '{stage}' for rank(s) "
                                  f"{', '.join(map(str, missing))} (stopped?); no byte moved.",
                                  {r: "did not report" for r in missing}) from exc
        values = {peer: pickle.loads(self.store.get(key)) for peer, key in keys.items()}
        for key in keys.values():
            self.store.delete_key(key)
        return values

    def exchange(self, stage: str, compute: Callable[[], tuple[dict[int, Any], Any] | None],
                 askers: list[int]) -> tuple[dict, dict]:
        """Values addressed rank to rank: `compute()` on this rank gives (peer -> value, a
        summary, or None); each value goes under a key of its pair, and only its peer reads
        it (then deletes it), from the ranks that asked it (`askers`, `asked_by`), while every
        rank reads every rank's summary, as `run` does. Returns (rank -> summary, rank -> its
        value to this rank): a rank's store traffic is its own pairs' values and the
        summaries, not the whole job's."""
        def publish() -> Any:
            computed = compute()
            if computed is None:
                return None
            values, summary = computed
            self.tell(stage, values)
            return summary

        summaries = self.run(stage, publish)
        return summaries, self.told(stage, [rank for rank in askers if summaries.get(rank) is not None])

    def close(self, stages: tuple[str, ...], asked: str | None = None, put: tuple[str, ...] = (),
              named: tuple[tuple[str, str], ...] = ()) -> None:
        """This rank read every value of `stages` (and of `put`, the stages values were `put` at,
        and the (stage, name) values `named`);
        the last rank to say so deletes them, so
        that a long job constructing many WeightSyncs does not grow the store (no rank waits:
        whoever counts last knows every other rank has read already)."""
        if asked is not None:  # this rank's counter of `ask`ing ranks: all read before `stages` ended
            count = self.store.add(self._key(asked, f"{self.rank}#"), 0)
            for key in [self._key(asked, f"{self.rank}#{i}") for i in range(1, count + 1)] + [
                    self._key(asked, f"{self.rank}#")]:
                self.store.delete_key(key)
        if self.store.add(f"{self.prefix}/read", 1) < len(self.ranks):
            return
        for key in [self._key(stage, r) for stage in stages for r in self.ranks] + [
                self._key(stage, f"{r}.put") for stage in put for r in self.ranks] + [
                self._key(stage, name) for stage, name in named] + [f"{self.prefix}/read"]:
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
