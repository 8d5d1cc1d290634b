"""The control plane of a weight sync (issue 39, "Scale"): each source rank reads only the
requests addressed to it, and each target rank chooses its copies from its own requests.
Every rank of a small job constructs its WeightSync in one process, as
benchmarks/bench_sync_plan.py does at full width (its tiny case, run here)."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_sync_plan

    return bench_sync_plan


def _requests_in(value, found: list) -> list:
    """Every sync Request inside a stored value (lists, tuples, dicts of them)."""
    from lazyload.sync.routes import Request

    if isinstance(value, Request):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _requests_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _requests_in(v, found)
    return found


def test_each_rank_reads_only_requests_of_it():
    """A 2-D trainer (FSDP 2 x TP 2) into 2 replicas of TP 2, every rank constructing: no rank
    reads from the store a request that asks another source rank (on main every rank read
    every target's requests); server ranks receive from the sources of their TP coordinate
    only, one message per source and step; the benchmark's table row prints."""
    bench = _bench()
    case = bench.CASES["tiny"]
    default = torch.get_default_dtype()
    result = bench.run_case(case, 1)
    assert torch.get_default_dtype() == default  # the simulation leaves the process as it found it
    store, trainers = result["store"], case.fsdp * case.tp
    read_by = {}
    for rank in range(result["world"]):
        for key in store.keys_read[rank]:
            try:
                value = pickle.loads(store.values[key])
            except Exception:
                continue  # a counter
            for request in _requests_in(value, []):
                read_by.setdefault(rank, set()).add(request.source)
    assert set(read_by) <= set(range(trainers)), read_by  # server ranks read no request
    assert all(sources == {rank} for rank, sources in read_by.items()), read_by
    assert result["messages"] <= result["holders"]
    assert "| tiny Llama" in bench.row(case, 1, result, bench.full_tensors(case))


def test_copies_chosen_without_the_other_targets():
    """A target rank's choice of copies is the same whether or not the other targets'
    requests are known (it makes it before any rank reads them), and replicas still spread."""
    from lazyload.expr import full_box
    from lazyload.sync.copies import choose_copies
    from lazyload.sync.routes import Request
    from lazyload.sync.source_index import source_index
    from test_sync import _two_d_sources

    index, pieces = source_index(_two_d_sources())
    keys = list(index.for_rank(0, 1).expr("norm").keys())
    wanted = [Request(0, pieces[k].rank, k, full_box([b - a for a, b in pieces[k].held.box]), torch.float32)
              for k in keys]
    together = choose_copies({8: wanted, 9: wanted}, pieces)
    assert together[9] == choose_copies({9: wanted}, pieces)[9]
    assert together[8] == choose_copies({8: wanted}, pieces)[8]
    assert {r.source for r in together[8]}.isdisjoint({r.source for r in together[9]})


def test_requests_read_are_checked_against_their_digest():
    """A source rank sends what the target addressed to it, at the steps the target chose,
    and the target receives in the same order; requests that differ from the digest their
    target computed of them (another lazyload there, a lost write) are a PlanError before any
    byte moves."""
    import dataclasses

    import pytest

    from lazyload.errors import PlanError
    from lazyload.sync.routes import Request, Slot, own_steps, pair_digest, published, routes_for

    wanted = [Request(0, 0, "w@0.0", ((0, 2),), torch.float32), Request(0, 1, "w@1.0", ((0, 2),), torch.float32),
              Request(1, 0, "v@0.0", ((0, 3),), torch.float32), Request(1, 2, "v@2.0", ((0, 3),), torch.float32)]
    wanted = own_steps(2, wanted, dict.fromkeys((0, 1), Slot(16)))
    pairs, summary = published(2, wanted)
    summaries = {0: None, 1: None, 2: summary}
    asked = {source: requests for source, (_, requests) in pairs.items()}
    assert sorted(asked) == [0, 1]  # rank 2's own copy goes over no wire
    assert pairs[0][0] == pair_digest(asked[0])
    source = routes_for(0, None, {2: (pair_digest(asked[0]), asked[0])}, summaries)
    target = routes_for(2, wanted, {}, summaries)
    assert [list(by) for by in source.sends.values()] == [[2], [2]]
    assert {s: {r: p for r, p in by.items()} for s, by in target.receives.items()} == {0: {0: (0,), 1: (1,)},
                                                                                      1: {0: (2,)}}
    assert target.local == {1: (3,)} and source.digest == target.digest and source.steps == target.steps == 2
    # a request that waits for the next step while a later one goes now: the steps are the latest's
    f32 = torch.float32
    waits = own_steps(2, [Request(0, 0, "a@0.0", ((0, 3),), f32), Request(0, 0, "b@0.0", ((0, 3),), f32),
                          Request(0, 1, "c@1.0", ((0, 1),), f32)], dict.fromkeys((0, 1), Slot(12)))
    assert [r.step for r in waits] == [0, 1, 0] and published(2, waits)[1].steps == 2
    tampered = [asked[0][0], dataclasses.replace(asked[0][1], box=((0, 2),))]
    with pytest.raises(PlanError, match="rank 2's requests of it"):
        routes_for(0, None, {2: (pair_digest(asked[0]), tampered)}, summaries)


def test_a_ranks_store_reads_grow_with_the_world_not_with_its_requests():
    """Every rank of a job constructing (the benchmark's tiny Llama, 2 or 6 replicas of TP 2,
    1 or 4 layers): apart from the layout exchange and the requests addressed to it, what a
    rank reads from the store grows with the ranks alone, a few hundred bytes each (a
    target's digest and steps, the agreement), not with their requests: the same per added
    rank at 4 layers as at 1. On main every rank read every target's request sizes (the
    steps were computed over all of them), so the growth per rank grew with the depth."""
    from dataclasses import replace

    bench = _bench()

    def busiest(replicas: int, layers: int) -> tuple[int, int]:
        result = bench.run_case(replace(bench.CASES["tiny"], replicas=replicas), layers)
        store = result["store"]

        def others(rank: int) -> int:  # bytes read of keys not addressed to this rank alone
            return sum(len(k) + len(store.values[k]) for k in store.keys_read[rank]
                       if bench.stage_of(k) != "layout" and not k.endswith(f">{rank}"))
        return max(others(rank) for rank in range(result["world"])), result["world"]

    per_rank = {}
    for layers in (1, 4):
        (few, small), (many, large) = busiest(2, layers), busiest(6, layers)
        per_rank[layers] = (many - few) / (large - small)
    assert per_rank[4] <= per_rank[1] + 16 and per_rank[4] < 400, per_rank


def test_a_source_rank_reads_no_other_ranks_layout():
    """A trainer rank (a source alone) reads from the store only its own layout and every
    rank's few bytes of status: what it reads at the layout exchange does not grow with the
    FSDP world (the benchmark's tiny job at FSDP 2 and 6), and it indexes only its own
    pieces. On main every rank read and indexed every trainer rank's layout."""
    from dataclasses import replace

    bench = _bench()

    def trainer_reads(fsdp: int) -> tuple[int, int]:
        case = replace(bench.CASES["tiny"], fsdp=fsdp)
        store = bench.run_case(case, 1)["store"]
        layout = [sum(len(k) + len(store.values[k]) for k in store.keys_read[rank] if bench.stage_of(k) == "layout")
                  for rank in range(fsdp * case.tp)]
        return max(layout), fsdp * case.tp + case.replicas * case.world

    (few, small), (many, large) = trainer_reads(2), trainer_reads(6)
    assert (many - few) / (large - small) < 100, (few, many)  # a status per added rank, no layout


def test_a_target_ranks_layouts_and_index_do_not_grow_with_the_fsdp_world():
    """A server rank reads each trainer mesh's strided rules once (what every rank of the
    mesh derives alike from its placements) instead of every trainer rank's boxes, and its
    index expands only the boxes its plan reads: at FSDP 2 and 6 (the benchmark's tiny job,
    8 and 16 ranks) its layout reads grow by a status per added rank, and the entries of
    its index whose box no item of its reads stay as many. On main a target read and
    indexed every trainer rank's boxes."""
    from dataclasses import replace

    bench = _bench()

    def target_figures(fsdp: int) -> tuple[int, int, int]:
        case = replace(bench.CASES["tiny"], fsdp=fsdp)
        result = bench.run_case(case, 1)
        store, world = result["store"], result["world"]
        layout = max(sum(len(k) + len(store.values[k]) for k in store.keys_read[rank] if bench.stage_of(k) == "layout")
                     for rank in range(fsdp * case.tp, world))
        sync = result["samples"][world - 1]  # the last server rank, constructed alone
        read = {(sync.pieces[item.entry.key].name, sync.pieces[item.entry.key].held.box) for item in sync.items}
        unread = [key for key in sync.index.keys()
                  if key not in sync.pieces or (sync.pieces[key].name, sync.pieces[key].held.box) not in read]
        return layout, len(unread), world

    (few, unread_few, small), (many, unread_many, large) = target_figures(2), target_figures(6)
    assert (many - few) / (large - small) < 100, (few, many)  # a status per added rank, no boxes
    assert unread_many == unread_few, (unread_few, unread_many)


def test_strided_rules_plan_the_sync_every_ranks_boxes_plan():
    """Exactness: the job planned from the trainers' strided rules (a target expanding only
    the boxes it reads) agrees on the plan digest, every rank's requests with their steps,
    with the job planned from every trainer rank's own boxes."""
    from dataclasses import replace

    bench = _bench()
    case = replace(bench.CASES["tiny"], fsdp=3)

    def digests(rules: bool) -> set:
        job_rules = bench.job_rules
        if not rules:
            bench.job_rules = lambda layouts, case: None
        try:
            store = bench.run_case(case, 2)["store"]
        finally:
            bench.job_rules = job_rules
        return {pickle.loads(v)[1] for k, v in store.values.items() if "/agreed/" in k}

    ruled, boxes = digests(True), digests(False)
    assert len(ruled) == 1 and ruled == boxes, (ruled, boxes)


def test_strided_index_fallbacks_plan_as_every_ranks_boxes(monkeypatch):
    """The target's two fallbacks to every box (`WeightSync._plan_target`, `_index_for`): where
    the plan over the boxes its preview read still reads a key left unexpanded, and where the
    boxes read do not tile with the rest (`indexed` raising CheckpointError), each server rank
    indexes every box and plans again: the same plan digest as from every trainer rank's own
    boxes. Neither input arises from a plan of today's planner (the preview reads what the
    plan reads), so each is forced here: the preview's boxes forgotten, a tiling refused."""
    from dataclasses import replace

    import lazyload.sync.weight_sync as weight_sync
    from lazyload.errors import CheckpointError

    bench = _bench()
    case = replace(bench.CASES["tiny"], fsdp=3)

    def digests() -> set:
        store = bench.run_case(case, 2)["store"]
        return {pickle.loads(v)[1] for k, v in store.values.items() if "/agreed/" in k}

    with monkeypatch.context() as patched:
        patched.setattr(bench, "job_rules", lambda layouts, case: None)
        boxes = digests()
    asked: list = []
    index_for = weight_sync.WeightSync._index_for

    def recorded(self, wanted):
        asked.append(wanted)
        return index_for(self, wanted)

    monkeypatch.setattr(weight_sync.WeightSync, "_index_for", recorded)
    with monkeypatch.context() as patched:  # the second plan reads unexpanded keys
        patched.setattr(weight_sync.WeightSync, "_read_boxes", lambda self: {})
        forgotten = digests()
    assert None in asked and {} in asked, asked
    indexed, refused, every = weight_sync.indexed, [], []

    def refusing(layouts, tiled=True, rules=None, ranks=None, wanted=None, own=None, prefer=None):
        if wanted:  # the boxes a target reads: "do not tile"
            refused.append(sorted(wanted))
            raise CheckpointError("the boxes read do not tile with the rest")
        if wanted is None and rules:
            every.append(len(refused))  # every box indexed, after how many refusals
        return indexed(layouts, tiled, rules, ranks, wanted, own, prefer)

    with monkeypatch.context() as patched:
        patched.setattr(weight_sync, "indexed", refusing)
        untiled = digests()
    assert refused and every and min(every) > 0, (len(refused), every)
    assert len(boxes) == 1 and forgotten == boxes and untiled == boxes, (boxes, forgotten, untiled)


def test_strided_rules_give_back_every_ranks_boxes():
    """`layout.strided`: the rules of a tensor's boxes give back exactly the boxes each rank
    holds (FSDP within TP on the same dim, FSDP across a rowwise TP split, replicated copies,
    ranks left empty by FSDP's chunks, uneven cuts), and none where a rank holds several boxes."""
    from dataclasses import replace

    from lazyload.sync.layout import Held, RuledTensor, strided

    bench = _bench()
    shapes = {"colwise.q_proj.weight": (13, 4), "rowwise.o_proj.weight": (5, 6), "norm.weight": (7,)}
    for fsdp, tp in ((3, 2), (8, 2), (4, 1)):
        case = replace(bench.CASES["tiny"], fsdp=fsdp, tp=tp)
        layouts = {rank: bench.trainer_layout(shapes, "torch.float32", case, rank) for rank in range(fsdp * tp)}
        for i, name in enumerate(shapes):
            held = {rank: layout[i].held for rank, layout in layouts.items()}
            rules = strided(held)
            tensor = RuledTensor(name, "torch.float32", shapes[name], rules)
            assert {rank: tensor.held_by(rank) for rank in held} == held, (name, fsdp, tp, rules)
            assert len(rules) <= 2 * tp, rules  # a rule per TP coordinate (and copy), not per FSDP rank
    uneven = {0: (Held(((0, 3),), (0,)),), 1: (Held(((3, 4),), (0,)),), 2: (Held(((4, 9),), (0,)),)}
    assert {r: RuledTensor("u", "torch.float32", (9,), strided(uneven)).held_by(r) for r in uneven} == uneven
    assert strided({0: (Held(((0, 2),), (0,)), Held(((4, 6),), (2,))), 1: (Held(((2, 4),), (0,)),)}) is None


def test_a_target_sizes_each_request_once(monkeypatch):
    """A server rank of a large job has thousands of requests (DeepSeek-V3's expert-parallel
    ranks: one per box of each of 256 FSDP ranks): its planning passes (windows, the largest
    request of each source, the default slots, the steps, the wire) size each request once,
    not once per pass; the request a source reads is the same value, its size not pickled."""
    import lazyload.sync.routes as routes
    from lazyload.sync.routes import Request, Slot, default_slots, largest_requests, own_steps

    sized = []

    def counted(kind, box):
        sized.append(box)
        return wire_bytes(kind, box)

    wire_bytes = routes.wire_bytes
    monkeypatch.setattr(routes, "wire_bytes", counted)

    class Item:  # a read item as `requests_of` reads it: its stored key's entry and its box
        def __init__(self, key, box):
            self.entry, self.src_box, self.target = type("Entry", (), {"key": key, "dtype": torch.float32}), box, key

    pieces = {f"model.layers.0.w@{r}.0": type("Piece", (), {"rank": r})() for r in range(8)}
    items = [Item(key, ((i, i + 4), (0, 8))) for i, key in enumerate(k for k in sorted(pieces) for _ in range(4))]
    requests = routes.requests_of(items, pieces, budget=4 * 8 * 4 * 6)
    largest_requests(9, requests)
    slots = default_slots(9, requests)
    stepped = own_steps(9, requests, {**slots, 0: Slot(4 * 8 * 4 * 2)})
    assert len(sized) == len(items), (len(sized), len(items))
    assert sorted({r.step for r in requests}) == [0, 1, 2, 3, 4, 5] and max(r.step for r in stepped) > 5
    sent = pickle.loads(pickle.dumps(stepped[-1]))
    assert sent == stepped[-1] and b"nbytes" not in pickle.dumps(stepped[-1]) and sent.nbytes == stepped[-1].nbytes == 128


def test_per_box_stages_run_without_the_cycle_collector(monkeypatch):
    """A target's per-box stages (indexing, planning, requests, copies, steps, digests, routes)
    make thousands of small objects per construction at scale, none in a cycle: they run with
    Python's cyclic collector paused (`gcpause`), which a rank's large heap would make rescan
    all along, and the collector is back on after. A rank of the tiny job, constructed alone
    over the store the job left."""
    import gc

    import lazyload.sync.weight_sync as weight_sync

    bench = _bench()
    case = bench.CASES["tiny"]
    result = bench.run_case(case, 1)
    seen: dict[str, set] = {}
    for name in ("indexed", "plan_load", "requests_of", "choose_copies", "own_steps", "published", "routes_for"):
        def watched(*args, _real=getattr(weight_sync, name), _name=name, **kwargs):
            seen.setdefault(_name, set()).add(gc.isenabled())
            return _real(*args, **kwargs)
        monkeypatch.setattr(weight_sync, name, watched)
    monkeypatch.setattr(weight_sync, "construction", lambda ranks: ("lazyload/sync/bench/0", 0))
    world = result["world"]
    store = result["store"]
    store.local.rank = "again"
    model = bench.meta_model(bench.config_of(case, 1))
    assert gc.isenabled()
    bench.construct(bench.simulated_sync({}), world - 1, world, store, model, case)
    assert gc.isenabled()
    assert seen.keys() == {"indexed", "plan_load", "requests_of", "choose_copies", "own_steps", "published",
                           "routes_for"}, seen
    assert all(states == {False} for states in seen.values()), seen


def test_a_sampled_rank_is_timed_in_a_process_of_its_own():
    """The benchmark's construction seconds: a rank constructed again over the job's store in a
    Python process of its own (its heap its own, as a rank runs), the same plan as in the job."""
    bench = _bench()
    case = bench.CASES["tiny"]
    result = bench.run_case(case, 1)
    world = result["world"]
    seconds = bench.time_apart(case, 1, result["store"], [0, world - 1], 2)
    assert sorted(seconds) == [0, world - 1]
    assert all(len(times) == 2 and all(t > 0 for t in times) for times in seconds.values()), seconds
