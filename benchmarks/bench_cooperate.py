"""Cooperating replicas at published shapes (issue 30, item 5): the split of a plan's reads
among the replicas of a ("dp", "tp") mesh and the exchange's collectives, before and after.

For each case, one tp rank's plan of a sparse checkpoint (benchmarks/sparse_checkpoint.py:
real headers, no data), and on it, per rank of the mesh:

- split s: the seconds one rank takes to compute its share (`cooperate.share_for`: who reads
  what, every rank computing the same) and its own read items (`Share.own`), best of 3 (the
  code before this change once: it takes up to a minute);
- collectives per layer: the broadcasts one rank takes part in, over all layers / layers,
  as "replicas' group + whole mesh" (the exchange's own batching, `cooperate.layer_batches`,
  on meta tensors, at a cooperative load's default budget, about a layer; before: one per piece);
- max/mean: the most bytes one replica reads from storage over the mean (the split's balance).

The code before is `lazyload/cooperate.py` at commit BEFORE, read with git (`--no-old` skips it).

    python benchmarks/bench_cooperate.py [--dir DIR] [--no-old] [--layers N]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparse_checkpoint  # noqa: E402

BEFORE = "e0df6e3"  # the last commit with the per-piece split and exchange
CASES = [("llama-405b", 512, 1), ("llama-405b", 128, 8), ("llama-405b", 64, 8), ("deepseek-v3", 16, 8)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_cooperate():
    """lazyload/cooperate.py as it was at BEFORE, imported inside the lazyload package."""
    source = subprocess.run(["git", "-C", REPO, "show", f"{BEFORE}:lazyload/cooperate.py"], check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("lazyload._cooperate_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "lazyload"
    sys.modules[spec.name] = module
    exec(compile(source, f"cooperate.py@{BEFORE}", "exec"), module.__dict__)
    return module


def tp_plan(directory, tp):
    """tp rank 0's plan (what every replica of that shard plans), and the seconds it took."""
    import torch
    import transformers

    from lazyload.planner import LoadOptions, plan_load
    from lazyload.stored import StoredCheckpoint

    config = transformers.AutoConfig.from_pretrained(directory)
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])._from_config(config, dtype=dtype)
    checkpoint = StoredCheckpoint(directory)
    checkpoint.index
    start = time.perf_counter()
    plan = plan_load(checkpoint, model, 0, tp, LoadOptions(strict=False, missing="keep"), preview=True)
    return plan, time.perf_counter() - start


def new_share(plan, dp, tp, me=0):
    from lazyload.cooperate import Circle, share_for

    return share_for(plan, Circle(None, me), dp, Circle(None, me) if tp > 1 else None, dp * tp)


def old_share(old, plan, dp, tp):
    """The share as `share_of` computed it at BEFORE (its mesh look-ups left out)."""
    whole = {t.name: 0 for t in plan.targets if tp > 1 and old._held_whole(plan, t)}
    for item in plan.items:
        if item.target in whole:
            whole[item.target] += item.nbytes
    rows = old.large_targets(plan, dp, frozenset(whole))
    readers = old.split_reads(plan.groups, dp, skip=frozenset(whole), rows=rows)
    if not whole:
        return old.Share(readers, old.Circle(None, 0), rows=rows)
    replicated_readers, replicated = old.split_replicated(whole, dp * tp)
    return old.Share({**readers, **replicated_readers}, old.Circle(None, 0), old.Circle(None, 0), replicated, rows)


def split_seconds(make, plan, runs):
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        make().own(plan.groups)
        best = min(best, time.perf_counter() - start)
    return best


def meta_dests(plan):
    import torch

    from lazyload.placer import TensorDest

    if plan.quantized:
        raise SystemExit("quantized on load: this benchmark makes plain (meta) destinations only")
    return {t.name: TensorDest(torch.empty(t.local_shape, dtype=plan.dtypes[t.name], device="meta"))
            for t in plan.targets}


def budget(plan):
    """The default budget of a cooperative load (every item copied: no views of the mapping)."""
    from lazyload.schedule import default_budget

    return default_budget(plan.groups)


def new_collectives(plan, share, dests):
    from lazyload.cooperate import layer_batches

    counts = {"dp": 0, "mesh": 0}
    for circle, batches in layer_batches(plan.groups, share, dests, budget(plan)):
        counts["dp" if circle is share.dp else "mesh"] += len(batches)
    return counts


def old_collectives(old, plan, share, dests):
    counts = {"dp": 0, "mesh": 0}
    replicated = share.replicated_names
    for layer in plan.groups:
        names = [n for n in dict.fromkeys(i.target for i in layer.items) if n not in replicated]
        names, pieces = old._pieces_of(names, share, dests)
        counts["dp"] += sum(len(list(old.pieces(t, budget(plan)))) for n in names for t in pieces[n].tensors(n).values())
    for names in share.replicated:
        counts["mesh"] += sum(len(list(old.pieces(t, budget(plan)))) for n in names
                              for t in dests[n].tensors(n).values())
    return counts


def new_balance(plan, share, dp):
    """max / mean of the bytes each replica reads of the replicas' split (replicated targets aside)."""
    sizes: dict[str, int] = {}
    for item in plan.items:
        sizes[item.target] = sizes.get(item.target, 0) + item.nbytes
    loads = [0] * dp
    for name, nbytes in sizes.items():
        if name in share.replicated_names:
            continue
        rows = share.rows.get(name)
        if rows is None:
            loads[share.readers[name]] += nbytes
            continue
        for i in range(rows.parts):
            start, end = rows.range(i)
            loads[rows.reader(i)] += nbytes * (end - start) // rows.count
    return max(loads) * dp / sum(loads)


def old_balance(old, plan, share, dp):
    loads = [0] * dp
    for group in plan.groups:
        for unit, nbytes in old._units(group.items, share.replicated_names, share.rows):
            loads[share.readers[unit]] += nbytes
    return max(loads) * dp / sum(loads)


def run_case(directory, dp, tp, old):
    plan, plan_seconds = tp_plan(directory, tp)
    share = new_share(plan, dp, tp)
    dests = meta_dests(plan)
    row = {"plan_s": plan_seconds, "items": len(plan.items), "layers": len(plan.groups),
           "new_s": split_seconds(lambda: new_share(plan, dp, tp), plan, 3),
           "new_calls": new_collectives(plan, share, dests), "new_balance": new_balance(plan, share, dp)}
    if old is not None:
        before = old_share(old, plan, dp, tp)
        row.update(old_s=split_seconds(lambda: old_share(old, plan, dp, tp), plan, 1),
                   old_calls=old_collectives(old, plan, before, dests), old_balance=old_balance(old, plan, before, dp))
    return row


def _calls(counts, layers):
    dp, mesh = counts["dp"] / layers, counts["mesh"] / layers
    return f"{dp:.0f} + {mesh:.0f}" if mesh else f"{dp:.0f}"


def print_table(rows):
    print("| checkpoint | mesh (dp, tp) | items per rank | plan s (tp rank) | split s per rank, before | after "
          "| collectives per layer, before | after | max/mean bytes read, before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, dp, tp), r in rows:
        before = [f"{r['old_s']:.2f}", _calls(r["old_calls"], r["layers"]), f"{r['old_balance']:.3f}"] \
            if "old_s" in r else ["-"] * 3
        print(f"| {name} | ({dp}, {tp}) | {r['items']:,} | {r['plan_s']:.2f} | {before[0]} | {r['new_s']:.3f} "
              f"| {before[1]} | {_calls(r['new_calls'], r['layers'])} | {before[2]} | {r['new_balance']:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the sparse checkpoints (a temporary one if not)")
    parser.add_argument("--no-old", action="store_true", help="leave out the code before this change")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick run)")
    parser.add_argument("--cases", default=None, help="some of the cases, e.g. llama-405b:64:8,deepseek-v3:16:8")
    args = parser.parse_args()
    old = None if args.no_old else old_cooperate()
    cases = CASES if args.cases is None else [(n, int(dp), int(tp)) for n, dp, tp in
                                              (c.split(":") for c in args.cases.split(","))]
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        rows = []
        for name in dict.fromkeys(name for name, _, _ in cases):
            directory = os.path.join(root, name)
            sparse_checkpoint.write(name, directory, layers=args.layers)
            rows += [((name, dp, tp), run_case(directory, dp, tp, old)) for n, dp, tp in cases if n == name]
    print_table(rows)


if __name__ == "__main__":
    main()
