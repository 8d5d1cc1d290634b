"""The cooperative split and the exchange's batches (cooperate.py), without processes: the
split of random layers of read items among replicas is a partition of every target's rows
(each row read by exactly one replica), the same every time it is computed and on every
rank, and balanced to within one whole target plus a row of each target cut into rows; a
real plan's share the same; batches pack every dtype bit for bit (a float32 target read from
bfloat16 goes as bfloat16, NaN payloads included) and stay within their byte limit."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazyload.cooperate import (Batch, Circle, Part, Rows, Share, batches, pack, share_for, split_reads,
                                unpack)
from lazyload.headers import TensorEntry
from lazyload.plan import ReadItem
from lazyload.schedule import Group

ITEMSIZE = 4  # float32


def _target(layer: int, index: int, rows: int, cols: int, cuts: list[int]) -> list[ReadItem]:
    """A (rows, cols) float32 target read from one source tensor per run of rows between `cuts`."""
    name = f"model.layers.{layer}.t{index}"
    bounds = sorted({0, rows, *(c for c in cuts if 0 < c < rows)})
    items = []
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        entry = TensorEntry(f"f{layer}.safetensors", f"{name}.{k}", torch.float32, (end - start, cols), 0,
                            (end - start) * cols * ITEMSIZE)
        items.append(ReadItem(entry, ((0, end - start), (0, cols)), (), name, ((start, end), (0, cols))))
    return items


@st.composite
def layers(draw):
    """Groups of targets (random rows, columns and source cuts), which targets may be cut
    into rows, and which are left out of the split (another circle's)."""
    groups, splittable, skip = [], set(), set()
    for layer in range(draw(st.integers(1, 4))):
        items = []
        for index in range(draw(st.integers(1, 7))):
            rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 6))
            target = _target(layer, index, rows, cols, draw(st.lists(st.integers(1, 39), max_size=3)))
            items += target
            choice = draw(st.sampled_from(["split", "whole", "skip"]))
            {"split": splittable, "skip": skip}.get(choice, set()).add(target[0].target)
        groups.append(Group(str(layer), tuple(items)))
    return groups, splittable, frozenset(skip)


def _rows_read(groups, readers, rows, replicas):
    """Per target, how many times each row is read (over every replica's own items), and
    each replica's bytes."""
    counts: dict[str, list[int]] = {}
    loads = [0] * replicas
    for replica in range(replicas):
        for group in Share(readers, Circle(None, replica), rows=rows).own(groups):
            for item in group.items:
                (start, end), (src_start, src_end) = item.dst_box[0], item.src_box[0]
                assert end - start == src_end - src_start and src_end <= item.entry.shape[0]
                column = counts.setdefault(item.target, [0] * _height(groups, item.target))
                for row in range(start, end):
                    column[row] += 1
                loads[replica] += item.nbytes
    return counts, loads


def _height(groups, name):
    return max(item.dst_box[0][1] for group in groups for item in group.items if item.target == name)


@settings(max_examples=150, deadline=None)
@given(layers(), st.integers(1, 9))
def test_the_split_is_a_deterministic_balanced_partition(case, replicas):
    groups, splittable, skip = case
    can_split = lambda name, items: name in splittable  # noqa: E731
    readers, rows = split_reads(groups, replicas, can_split, skip)
    assert (readers, rows) == split_reads([Group(g.layer, tuple(g.items)) for g in groups], replicas, can_split, skip)
    names = {item.target for group in groups for item in group.items}
    assert readers.keys() | rows.keys() == names - skip and not readers.keys() & rows.keys()
    assert all(0 <= r < replicas for r in readers.values()) and all(r.parts == replicas for r in rows.values())
    kept = [Group(g.layer, tuple(i for i in g.items if i.target not in skip)) for g in groups]
    counts, loads = _rows_read(kept, readers, rows, replicas)
    assert counts.keys() == names - skip
    assert all(c == 1 for column in counts.values() for c in column), "a row read twice or never"
    sizes = {n: sum(i.nbytes for g in kept for i in g.items if i.target == n) for n in counts}
    row_bytes = sum(sizes[n] // rows[n].count for n in rows)  # a range is at most one row longer than another
    assert max(loads) - min(loads) <= max([sizes[n] for n in readers] + [0]) + row_bytes


@given(st.integers(0, 50), st.integers(1, 12), st.integers(0, 30))
def test_row_ranges_tile_the_target_one_per_replica(count, parts, first):
    rows = Rows(count, parts, first % parts)
    ranges = [rows.range(i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(end - start in (count // parts, -(-count // parts)) for start, end in ranges)
    assert sorted(rows.reader(i) for i in range(parts)) == list(range(parts))
    assert all(rows.of(rows.reader(i)) == ranges[i] for i in range(parts))


def test_a_real_plans_share_is_the_same_on_every_replica_and_covers_its_items(checkpoint):
    from lazyload.planner import LoadOptions, plan_load
    from lazyload.stored import StoredCheckpoint
    from checkpoints import build_model

    directory, config = checkpoint("llama", "bf16")
    plan = plan_load(StoredCheckpoint(str(directory)), build_model("llama", config, torch.float32), 0, 1,
                     LoadOptions(strict=False), preview=True)
    shares = [share_for(plan, Circle(None, me), 3) for me in range(3)]
    assert all((s.readers, s.rows, s.wire) == (shares[0].readers, shares[0].rows, shares[0].wire) for s in shares)
    assert shares[0].rows and set(shares[0].wire.values()) == {torch.bfloat16}  # bf16 read into float32
    read = sum(item.nbytes for s in shares for group in s.own(plan.groups) for item in group.items)
    assert read == sum(item.nbytes for item in plan.items)


def _bits(tensor):
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _random(dtype, shape):
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8)
    return raw.view(dtype) if dtype != torch.bool else raw % 2 == 1


DTYPES = [torch.float8_e4m3fn, torch.uint8, torch.bool, torch.bfloat16, torch.float16, torch.int8,
          torch.float32, torch.int32, torch.float64, torch.int64]


def test_a_batch_packs_every_dtype_bit_for_bit_and_unpacks_it():
    sent = [_random(d, (5, 3)) for d in DTYPES] + [_random(torch.float32, (4, 6)).t()]  # one not contiguous
    batch = Batch(0, tuple(Part(t, t.dtype) for t in sent))
    packed = torch.empty(batch.nbytes, dtype=torch.uint8)
    pack(batch, packed)
    got = [torch.zeros_like(t) for t in sent]
    unpack(Batch(0, tuple(Part(t, t.dtype) for t in got)), packed)
    for want, have in zip(sent, got):
        assert torch.equal(_bits(want), _bits(have)), want.dtype
    assert batch.nbytes < sum(t.nbytes for t in sent) + 8 * len(sent)  # alignment only, no more


def test_float32_read_from_bfloat16_goes_as_bfloat16_bytes_nan_payloads_included():
    special = torch.tensor([0x7F81, -0x7E, 0x7F80, -0x8000, 0x0001, 0x3F80], dtype=torch.int16)  # NaNs, inf, -0, ...
    stored = torch.cat([special, torch.randint(-2**15, 2**15, (60,), dtype=torch.int16)]).view(torch.bfloat16)
    held = stored.float().reshape(6, 11)
    batch = Batch(0, (Part(held, torch.bfloat16),))
    assert not batch.direct and batch.nbytes == stored.nbytes
    packed = torch.empty(batch.nbytes, dtype=torch.uint8)
    pack(batch, packed)
    assert torch.equal(packed.view(torch.int16), stored.view(torch.int16))  # the bytes read, as read
    received = torch.zeros(6, 11)
    unpack(Batch(0, (Part(received, torch.bfloat16),)), packed)
    assert torch.equal(received.view(torch.int32), held.view(torch.int32))


@pytest.mark.parametrize("limit", [4, 24, 100, 10_000])
def test_batches_keep_each_readers_parts_in_order_within_the_limit(limit):
    tensors = {0: [torch.arange(12.0).reshape(3, 4), torch.arange(5.0)], 2: [torch.arange(6.0).reshape(2, 3)]}
    parts = {r: [Part(t, t.dtype) for t in ts] for r, ts in tensors.items()}
    made = batches(parts, limit)
    assert [b.reader for b in made] == sorted(b.reader for b in made)
    assert all(b.nbytes <= limit for b in made)
    for reader, ts in tensors.items():
        sent = torch.cat([p.tensor.reshape(-1) for b in made if b.reader == reader for p in b.parts])
        assert torch.equal(sent, torch.cat([t.reshape(-1) for t in ts]))
    if limit >= 10_000:
        assert len(made) == len(tensors)  # one collective per reader
