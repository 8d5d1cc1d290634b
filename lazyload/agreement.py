"""Rank agreement: the ranks of a torch.distributed load tell each other whether they got
past each stage, and what they planned, so that one rank's failure (or a replica that
planned another load) reaches every other one within a bounded time, instead of leaving
them waiting forever in the next collective or exchanging bytes they do not agree on.

Through the default process group's key-value store (no collective: a rank that failed
or died cannot block it), as a tree of `FANOUT` children per rank: at each point every
rank sets its report (its error, or "ok" and the facts it compares: `digest.load_facts`),
waits (at most `timeout` seconds) for its children's, merges them and passes the merge up;
the first rank of the load judges the whole (failed ranks, ranks that did not report,
facts that differ) and publishes one verdict that every rank reads. Each rank thus reads
O(FANOUT) reports, not O(world), and every rank raises the same error. A missing child's
subtree is read rank by rank, so that the rank that did not report is the one named.

Loads are numbered per process: every rank of a job calls `load_into` the same number of
times, as with any collective. A rank that fails publishes its error at the next point and
takes part in it too, so that the store (hosted by rank 0) outlives the others' reads.

Collectives after "read" (the replicas' exchange, `cooperate.py`) run inside
`Agreement.collectives`: each wait is bounded (`wait_all`), a rank whose wait fails or
times out reports that it waited, a rank that raises reports its error, and the
"exchanged" point tells every rank which rank failed.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

from .errors import ExchangeError, LazyLoadError, RankFailedError

logger = logging.getLogger("lazyload")
_loads = itertools.count()
FANOUT = 16  # children per rank of the agreement's tree
RANK_TIMEOUT = 60.0  # default seconds a rank waits for another (`rank_timeout` of a load, a sync, vLLM's workers)
GRACE = 10.0  # seconds more that a rank waits for the verdict, and the store's host for its readers
NAMED = 32  # failed ranks whose errors a verdict carries (the others counted)
# Where ranks agree: input checked and planned, before the model changes (or any byte is
# read); everything read, before the model is made runnable (tensors assigned); and, when
# replicas exchange what they read, once the exchange is over.
POINTS = ("planned", "read")
_collective_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar("lazyload_collective_timeout",
                                                                                   default=None)


class CollectiveError(RankFailedError):
    """A collective of the exchange failed or did not finish in time on this rank: another
    rank failed or stopped (the "exchanged" point says which)."""


class Agreement:
    """The points of one load at which ranks agree; `NoAgreement` outside a process group."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float, ranks: list[int] | None = None,
                 points: tuple[str, ...] = POINTS, prefix: str | None = None, job: str = "load"):
        """`ranks`: the global ranks of the load (a device mesh's), `rank` being this process's;
        default all `world` ranks of the process group. `points`: where they agree (a weight
        sync: none but the "exchanged" of its `collectives`); `prefix`: its store keys'
        (default: numbered per load); `job`: what the messages call it ("load" or "sync")."""
        self.store, self.rank, self.timeout, self.job = store, rank, timeout, JOBS[job]
        self.ranks = list(range(world)) if ranks is None else ranks
        self.world = len(self.ranks)
        self.pos = self.ranks.index(rank)
        # a mesh's loads are numbered apart from other meshes' (disjoint groups of one job)
        self.prefix = prefix or f"lazyload/{next(_loads)}" + ("" if ranks is None else f"@{self.ranks[0]}")
        self.points = list(points)
        self.passed = 0  # points passed
        self.settled = False  # a point already told everyone the outcome

    def reached(self, point: str, seconds: float | None = None, facts: list | None = None) -> None:
        """This rank got to `point` (the next one); returns once every rank did, or raises
        RankFailedError naming the ranks that failed (or planned otherwise) and why.
        `seconds`: how long this rank took to get there (the first rank logs the slowest);
        `facts`: (field, group, value) this rank's peers must share (see `load_facts`)."""
        assert point == self.points[self.passed], f"agreement points out of order: {point}"
        verdict = self._agree(point, _report(self.rank, seconds=seconds, facts=facts))
        self.passed += 1
        if verdict["failed"] or verdict["waited"]:
            self.settled = True
            raise RankFailedError(_message(self.rank, point, verdict, self.job), _named(verdict))
        if seconds is not None and self.pos == 0 and verdict["seconds"]:
            (slow, s_slow), (fast, s_fast) = verdict["seconds"]
            logger.info("lazyload: rank %d was the slowest to '%s': %.2f s, %.2f s behind the fastest (rank %d, %.2f s)",
                        slow, point, s_slow, s_slow - s_fast, fast, s_fast)

    def failed(self, exc: BaseException) -> None:
        """This rank failed: tell the others at the next point (and wait, bounded, for them
        to read it). Nothing to tell once past the last point, or once settled."""
        if not self.settled and self.passed < len(self.points):
            self.settled = True
            try:
                self._agree(self.points[self.passed], _report(self.rank, error=f"{type(exc).__name__}: {exc}"))
            except RankFailedError:  # the store is gone: nobody is left to tell
                pass

    @contextlib.contextmanager
    def collectives(self, active: bool = True) -> Iterator[None]:
        """Collectives between ranks ("exchanged" when `active`): every `wait_all` inside is
        bounded by `timeout`; a rank whose collective failed or stalled learns at the
        "exchanged" point which rank failed (RankFailedError); an error of this rank's own
        becomes an ExchangeError, told to the others as any failure is."""
        if not active:
            yield
            return
        self.points.append("exchanged")
        token = _collective_timeout.set(self.timeout)
        try:
            yield
        except CollectiveError as exc:
            self.settled = True
            # it waited `timeout` already: a rank that died is not waited for that long again
            verdict = self._agree("exchanged", _report(self.rank, waited=str(exc)), min(self.timeout, GRACE))
            raise RankFailedError(_message(self.rank, "exchanged", verdict, self.job), _named(verdict)) from exc
        except LazyLoadError:
            raise
        except Exception as exc:
            raise ExchangeError(f"rank {self.rank}: the exchange with the other replicas failed here ("
                                f"{type(exc).__name__}: {exc}); every rank stops. Fix this rank's error and re-run "
                                "every rank.") from exc
        finally:
            _collective_timeout.reset(token)
        self.reached("exchanged")

    def forget(self, point: str) -> None:
        """Delete this rank's keys of `point` (the first rank's: the verdict and its counters
        too), once every rank has read them: a caller agreeing again and again keeps the store's
        size."""
        keys = [self._key(point, "in", self.pos), self._key(point, "sub", self.pos)]
        if self.pos == 0:
            keys += [f"{self.prefix}/{point}/{what}" for what in ("verdict", "read", "all-read")]
        for key in keys:
            self.store.delete_key(key)

    # --- the tree ---

    def _key(self, point: str, what: str, pos: int) -> str:
        return f"{self.prefix}/{point}/{what}{pos}"

    def _agree(self, point: str, report: dict, timeout: float | None = None) -> dict:
        """Publish this rank's report at `point`, pass its subtree's merge up, and return the
        verdict the first rank published; a store that stops answering is a RankFailedError."""
        try:
            return self._tree(point, report, self.timeout if timeout is None else timeout)
        except RankFailedError:
            raise
        except Exception as exc:  # the store's host (rank 0 of the default group) is gone
            raise RankFailedError(
                f"rank {self.rank}: the process group's key-value store stopped answering at '{point}' "
                f"({type(exc).__name__}: {exc}): its host, rank 0, has exited or crashed. Re-run every rank.",
                {0: "its key-value store stopped answering"}) from exc

    def _tree(self, point: str, report: dict, timeout: float) -> dict:
        arrived = time.monotonic()
        self.store.set(self._key(point, "in", self.pos), json.dumps(report))
        children = [c for c in range(FANOUT * self.pos + 1, FANOUT * self.pos + FANOUT + 1) if c < self.world]
        if children:
            merged = self._children(point, report, children, arrived + timeout)
            self.store.set(self._key(point, "sub", self.pos), json.dumps(merged))
            report = merged
        if self.pos == 0:
            self.store.set(f"{self.prefix}/{point}/verdict", json.dumps(_verdict(report, timeout, self.job)))
        verdict = self._verdict(point, arrived + 2 * self.timeout + GRACE)
        if verdict["failed"] or verdict["waited"]:
            self._all_read(point, self.world - len(verdict["late"]))
        return verdict

    def _children(self, point: str, report: dict, children: list[int], deadline: float) -> dict:
        """This rank's report merged with its children's subtrees' (a child's subtree that
        did not pass its merge up in time is read rank by rank)."""
        keys = {c: self._key(point, "sub" if _has_children(c, self.world) else "in", c) for c in children}
        late = self._wait_keys(list(keys.values()), deadline)
        present = [c for c in children if keys[c] not in late]
        for value in self.store.multi_get([keys[c] for c in present]) if present else []:
            report = _merge(report, json.loads(value))
        for child in (c for c in children if keys[c] in late):
            report = self._subtree(point, report, child)
        return report

    def _subtree(self, point: str, report: dict, top: int) -> dict:
        """Merge the reports of `top`'s subtree one by one; those missing are late."""
        level = [top]
        while level:
            for pos in level:
                key = self._key(point, "in", pos)
                if self.store.check([key]):
                    report = _merge(report, json.loads(self.store.get(key)))
                else:
                    report = _merge(report, _report(self.ranks[pos], late=True))
            level = [c for p in level for c in range(FANOUT * p + 1, FANOUT * p + FANOUT + 1) if c < self.world]
        return report

    def _verdict(self, point: str, deadline: float) -> dict:
        key = f"{self.prefix}/{point}/verdict"
        if self._wait_keys([key], deadline):
            first = self.ranks[0]
            raise RankFailedError(f"rank {self.rank}: rank {first}, which collects the ranks' reports at '{point}', "
                                  f"did not publish their outcome within {2 * self.timeout + GRACE:g} s (it crashed or "
                                  "hangs). Re-run every rank.", {first: "did not publish the agreement's outcome"})
        return json.loads(self.store.get(key))

    def _wait_keys(self, keys: list[str], deadline: float) -> set[str]:
        """The keys still missing at the deadline."""
        try:
            self.store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            return set()
        except Exception:  # the store's timeout (its error type differs between stores)
            return {key for key in keys if not self.store.check([key])}

    def _all_read(self, point: str, readers: int) -> None:
        """After a failure, wait (bounded, from now) until every rank that reported has read
        the verdict: the store's host must outlive their reads."""
        if int(self.store.add(f"{self.prefix}/{point}/read", 1)) >= readers:
            self.store.set(f"{self.prefix}/{point}/all-read", "1")
        self._wait_keys([f"{self.prefix}/{point}/all-read"], time.monotonic() + GRACE)


def _has_children(pos: int, world: int) -> bool:
    return FANOUT * pos + 1 < world


def _report(rank: int, *, error: str | None = None, waited: str | None = None, late: bool = False,
            seconds: float | None = None, facts: list | None = None) -> dict:
    """One rank's report (the form of a subtree's merge): its error, or that it waited for
    a collective that failed, or did not report (`late`), its seconds to the point and its facts."""
    return {"failed": {str(rank): error} if error is not None else {},
            "waited": {str(rank): waited} if waited is not None else {},
            "late": [rank] if late else [], "count": int(error is not None or late),
            "seconds": [[rank, seconds], [rank, seconds]] if seconds is not None else None,
            "facts": {f"{i:04d} {field}" + (f" of {group}" if group else ""): {json.dumps(value): [1, [rank]]}
                      for i, (field, group, value) in enumerate(facts or ())}}


def _merge(a: dict, b: dict) -> dict:
    """Two subtrees' reports as one (at most NAMED errors of each kind kept)."""
    facts = {key: dict(values) for key, values in a["facts"].items()}
    for key, values in b["facts"].items():
        mine = facts.setdefault(key, {})
        for value, (count, ranks) in values.items():
            had = mine.get(value, [0, []])
            mine[value] = [had[0] + count, sorted(had[1] + ranks)[:4]]
    seconds = a["seconds"] or b["seconds"]
    if a["seconds"] and b["seconds"]:
        seconds = [max(a["seconds"][0], b["seconds"][0], key=lambda x: x[1]),
                   min(a["seconds"][1], b["seconds"][1], key=lambda x: x[1])]
    return {"failed": _capped({**a["failed"], **b["failed"]}), "waited": _capped({**a["waited"], **b["waited"]}),
            "late": sorted(a["late"] + b["late"]), "count": a["count"] + b["count"], "seconds": seconds, "facts": facts}


def _capped(errors: dict[str, str]) -> dict[str, str]:
    return dict(sorted(errors.items(), key=lambda kv: int(kv[0]))[:NAMED])


def _verdict(report: dict, timeout: float, job: "Job") -> dict:
    """What the first rank publishes: the failed, waiting and late ranks, and the first
    fact whose value differs between ranks (the ranks of its rarest values named)."""
    failed = dict(report["failed"])
    for rank in report["late"][:NAMED]:
        failed[str(rank)] = f"did not report within {timeout:g} s (it crashed, hangs, or did not {job.call})"
    for key in sorted(report["facts"]):
        values = report["facts"][key]
        if len(values) > 1 and not failed:
            # the value of the most ranks (ties: the lowest rank's) is the reference; the others differ
            ref = max(values, key=lambda v: (values[v][0], -values[v][1][0]))
            for value, (count, ranks) in values.items():
                for rank in ranks if value != ref else ():
                    failed[str(rank)] = (f"planned another load: its {key[5:]} is {json.loads(value)!r} where rank "
                                         f"{values[ref][1][0]}'s is {json.loads(ref)!r}" + _hint(key[5:]))
            break
    return {"failed": failed, "waited": report["waited"], "late": report["late"], "seconds": report["seconds"],
            "count": report["count"]}


_HINTS = {"plan.": " (digest.plan_json(plan) or `lazyload plan --json` shows each plan field by field)",
          "checkpoint": " (each rank's copy of the checkpoint must store the same tensors: keys, dtypes, shapes)"}


def _hint(fact: str) -> str:
    return next((hint for start, hint in _HINTS.items() if fact.startswith(start)), "")


def _named(verdict: dict) -> dict[int, str]:
    """The ranks a RankFailedError names: those that failed, else those that waited."""
    return {int(r): text for r, text in (verdict["failed"] or verdict["waited"]).items()}


@dataclass(frozen=True)
class Job:
    """How messages name what the ranks agree about."""

    name: str  # "the load"
    call: str  # what a rank that never reported did not do
    then: str  # what this rank did, and what to do


JOBS = {"load": Job("the load", "call load_into", "this rank stopped before making its model runnable. Fix the "
                    "failing rank's error (or make every rank load the same way) and re-run every rank."),
        "sync": Job("the weight sync", "call the sync", "this rank stopped waiting for it. Fix the failing rank's "
                    "error (or restart it) and call the sync again on every rank.")}


def _message(rank: int, point: str, verdict: dict, job: Job = JOBS["load"]) -> str:
    named = _named(verdict)
    what = "; ".join(f"rank {r}: {text}" for r, text in sorted(named.items()))
    more = verdict.get("count", 0) - len(named) if verdict["failed"] else 0
    what += f"; and {more} more" if more > 0 else ""
    waited = sorted(int(r) for r in verdict["waited"]) if verdict["failed"] else []
    tail = f" (ranks {', '.join(map(str, waited))} stopped waiting for it in the exchange)" if waited else ""
    return f"rank {rank}: {job.name} failed on {len(named)} rank(s) before '{point}' ({what}){tail}; {job.then}"


@contextlib.contextmanager
def bounded_collectives(timeout: float) -> Iterator[None]:
    """Every `wait_all` inside waits at most `timeout` seconds (a group with no agreement of
    ours: an engine's TP workers sharing their fetches, `integrations.tp_share`)."""
    token = _collective_timeout.set(timeout)
    try:
        yield
    finally:
        _collective_timeout.reset(token)


def wait_all(works: list, what: str = "a collective") -> None:
    """Wait for torch.distributed works; inside `Agreement.collectives`, all of them within
    its timeout from now (a CollectiveError when one fails or does not finish in time)."""
    timeout = _collective_timeout.get()
    deadline = None if timeout is None else time.monotonic() + timeout
    for work in works:
        try:
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:
            stalled = "timed out" in str(exc).lower()
            raise CollectiveError(f"{what} " + (f"did not finish within {timeout:g} s" if stalled else
                                                f"failed ({type(exc).__name__}: {exc})")) from exc


class NoAgreement:
    """A load outside a process group (or not this group's rank and world): nothing to agree."""

    settled = True

    def reached(self, point: str, seconds: float | None = None, facts: list | None = None) -> None:
        pass

    def failed(self, exc: BaseException) -> None:
        pass

    @contextlib.contextmanager
    def collectives(self, active: bool = True) -> Iterator[None]:
        yield


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
    if not in_process_group(rank, world):
        return NoAgreement()
    return Agreement(_get_default_store(), rank, world, timeout)


def in_process_group(rank: int, world: int) -> bool:
    """Whether (rank, world > 1) are those of torch.distributed's initialised default group:
    the group a load's collectives run in."""
    import torch.distributed as dist

    return (world > 1 and dist.is_available() and dist.is_initialized()
            and (dist.get_rank(), dist.get_world_size()) == (rank, world))
