"""The agreement's tree (lazyload/agreement.py) over a real torch.distributed key-value
store, one thread per rank, at a world larger than its fan-out (so that reports pass
through ranks that collect their subtrees): every rank ends with the same outcome; a rank
that failed, did not report, or planned another load is the one named, wherever it sits
in the tree. The gloo jobs with real loads are tests/test_exchange_faults.py."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lazyload import RankFailedError
from lazyload.agreement import FANOUT, Agreement
from lazyload.errors import ReadError

WORLD = 2 * FANOUT + 5  # rank 1 collects ranks 17..32; rank 2 collects 33..36


def _run(body, world=WORLD, timeout=5.0, skip=()):
    """Run `body(agreement)` on a thread per rank (not those in `skip`); rank -> what it
    returned or raised."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    agreements = [Agreement(store, r, world, timeout) for r in range(world)]
    for a in agreements:
        a.prefix = "test"  # one load: threads of one process would number their loads apart
    outcomes: dict[int, object] = {}

    def rank(a):
        try:
            outcomes[a.rank] = body(a)
        except Exception as exc:  # the outcome under test
            outcomes[a.rank] = exc

    threads = [threading.Thread(target=rank, args=(a,)) for a in agreements if a.rank not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return outcomes


def _facts(rank, dims=("dp", "tp")):
    return [("mesh dims", "", list(dims)), ("plan.items", f"tp rank {rank % 2}", f"digest{rank % 2}")]


def test_every_rank_passes_when_all_agree():
    def body(a):
        a.reached("planned", facts=_facts(a.rank))
        a.reached("read", seconds=0.01 * a.rank)
        return "done"

    assert _run(body) == {r: "done" for r in range(WORLD)}


@pytest.mark.parametrize("failing", [0, 1, 20, WORLD - 1])  # the root, a collector, a leaf under one, the last
def test_a_failing_rank_is_named_on_every_other_rank(failing):
    def body(a):
        a.reached("planned")
        if a.rank == failing:
            exc = ReadError("disk on fire")
            a.failed(exc)
            raise exc
        a.reached("read")

    outcomes = _run(body)
    assert isinstance(outcomes.pop(failing), ReadError)
    for rank, exc in outcomes.items():
        assert isinstance(exc, RankFailedError) and list(exc.ranks) == [failing], (rank, exc)
        assert "ReadError: disk on fire" in str(exc) and "before 'read'" in str(exc)


@pytest.mark.parametrize("missing", [1, 2, 20])  # collectors (their subtrees read rank by rank), a leaf
def test_a_rank_that_never_reports_is_the_one_named(missing):
    outcomes = _run(lambda a: a.reached("planned"), timeout=1.0, skip={missing})
    assert missing not in outcomes and len(outcomes) == WORLD - 1
    for rank, exc in outcomes.items():
        assert isinstance(exc, RankFailedError) and list(exc.ranks) == [missing], (rank, exc)
        assert f"rank {missing}: did not report within 1 s" in str(exc)


def test_a_rank_that_planned_otherwise_is_named_with_the_first_differing_field():
    odd = 21

    def body(a):
        a.reached("planned", facts=_facts(a.rank, ("tp", "dp") if a.rank == odd else ("dp", "tp")))

    outcomes = _run(body)
    assert set(outcomes) == set(range(WORLD))  # every rank, the odd one too, raises the same error
    for rank, exc in outcomes.items():
        assert isinstance(exc, RankFailedError) and list(exc.ranks) == [odd], (rank, exc)
        assert "its mesh dims is ['tp', 'dp'] where rank 0's is ['dp', 'tp']" in str(exc)


def test_replicas_compare_within_their_group_and_a_tie_names_the_higher_rank():
    """Two replicas of shard 1 disagree (ranks 1 and 3 of 4): rank 1's plan is the reference."""
    def body(a):
        facts = [("plan.items", f"tp rank {a.rank % 2}", "other" if a.rank == 3 else f"digest{a.rank % 2}")]
        a.reached("planned", facts=facts)

    outcomes = _run(body, world=4)
    for rank, exc in outcomes.items():
        assert isinstance(exc, RankFailedError) and list(exc.ranks) == [3], (rank, exc)
        assert "plan.items of tp rank 1 is 'other' where rank 1's is 'digest1'" in str(exc)


class _Counting:
    """One rank's view of the shared store, counting the keys it reads or waits for."""

    def __init__(self, store):
        self.store, self.keys = store, 0

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        self.keys += 1
        return self.store.get(key)

    def multi_get(self, keys):
        self.keys += len(keys)
        return self.store.multi_get(keys)

    def wait(self, keys, timeout):
        self.keys += len(keys)
        return self.store.wait(keys, timeout)

    def check(self, keys):
        self.keys += len(keys)
        return self.store.check(keys)

    def add(self, key, amount):
        return self.store.add(key, amount)


def test_each_rank_reads_a_bounded_number_of_reports_not_every_rank():
    """At world 100 (> FANOUT^1), a point costs each rank its children's reports and the
    verdict: O(FANOUT) keys, not O(world) (the store carries O(world) in all)."""
    world = 100
    store = dist.HashStore()
    views = [_Counting(store) for _ in range(world)]
    agreements = [Agreement(views[r], r, world, 30.0) for r in range(world)]
    for a in agreements:
        a.prefix = "count"
    threads = [threading.Thread(target=a.reached, args=("planned",), kwargs={"facts": _facts(a.rank)})
               for a in agreements]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    assert max(v.keys for v in views) <= 2 * FANOUT + 2, [v.keys for v in views]
    assert sum(v.keys for v in views) <= 4 * world
