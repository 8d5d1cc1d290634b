"""Scale proof: 405B to 671B checkpoints at their published shapes, on this host.

The checkpoints are sparse (benchmarks/sparse_checkpoint.py: real headers, data regions
that are holes and read as zeros), so these runs measure the index, the plan, scheduling,
memory and I/O paths at full scale. One run prints one table per checkpoint:

- index: seconds and bytes read for the whole checkpoint (headers only), cold and warm;
- plan: seconds for one rank, and per-rank bytes, at world 8, 64 and 128 (tensor parallel;
  expert parallel too for the MoE models), with a check that every rank's weight bytes add
  up to the checkpoint (each replicated tensor once per rank; scale blocks at slice edges
  are read by both neighbours, so scales are left out of the sum);
- load: a real `load_into` of one rank's share (rank 0 of `--world`), cold page cache, in a
  fresh process inside a memory cgroup limited to its destination + 2 GB: seconds, GB/s,
  peak RSS, anonymous and file-backed memory, kernel CPU seconds; for the first 16 layers
  and for all of them (time should grow linearly with layers), with each reader;
- the whole-file approach on the same rank (every file the rank needs read whole with
  safetensors' `load_file`, its slices copied out, the file freed), 16 layers;
- an 8-thread `pread` of the rank's exact page-granular ranges into one buffer.

    python benchmarks/bench_scale.py --dir /path/with/room [--shapes llama-405b,deepseek-v3,llama4-maverick]

The checkpoints take almost no disk (holes), but reads fill the page cache with zeros:
cold runs need root to drop it (`/proc/sys/vm/drop_caches`) and to make cgroups.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import sparse_checkpoint  # noqa: E402
from common import CaseSkipped  # noqa: E402

GB = 1e9
SHORT_LAYERS = 16


# --------------------------------------------------------------------------- in-process measures

def measure_index(directory):
    from lazyload.formats import open_index, resolve

    io0 = common.read_io()
    t0 = time.perf_counter()
    index = open_index(resolve(directory))
    seconds = time.perf_counter() - t0
    io = common.read_io()
    return {"seconds": seconds, "tensors": len(index), "files": len(index.files),
            "header_bytes": index.header_bytes_read, "storage_bytes": io["read_bytes"] - io0["read_bytes"],
            "checkpoint_bytes": index.total_bytes}


def meta_model(directory, **config_fields):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, **config_fields)
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    with torch.device("meta"):  # in the checkpoint's dtype, as from_pretrained(dtype="auto") builds it
        return getattr(transformers, config.architectures[0])._from_config(config, dtype=dtype)


def rank_plan(directory, model, world, rank, plan=None):
    """(targets, items) of one rank, as load_into plans them (`planner.plan_load`, without
    this host's probes), the seconds it took, and the mapping. Under "ep" each rank's shares
    are planned as `shards_only=True` loads them: attention split over groups of ranks is no
    layout lazyload makes runnable (the README's expert-parallel note)."""
    from lazyload.planner import plan_load
    from lazyload.stored import StoredCheckpoint

    checkpoint = StoredCheckpoint(directory)
    checkpoint.index  # headers first: the index is not the plan
    t0 = time.perf_counter()
    planned = plan_load(checkpoint, model, rank, world, _options(plan), preview=True)
    return planned.targets, planned.items, time.perf_counter() - t0, planned.mapping


def plan_cpu_seconds(directory, model, world, plan=None, rank=0):
    """CPU seconds of one rank's plan_load: map, placements, plan and schedule together."""
    from lazyload.planner import plan_load
    from lazyload.stored import StoredCheckpoint

    checkpoint = StoredCheckpoint(directory)
    checkpoint.index
    t0 = time.process_time()
    plan_load(checkpoint, model, rank, world, _options(plan), preview=True)
    return time.process_time() - t0


def _options(plan):
    """The load's options: under "ep" shards_only (see `rank_plan`)."""
    from lazyload.planner import LoadOptions

    return LoadOptions(plan=plan, strict=False, missing="keep", shards_only=plan == "ep")


def measure_plan(directory, model, world, plan=None, all_ranks=True):
    """Rank 0's planning seconds; per-rank bytes (every rank, or ranks 0 and world-1), and
    whether they add up: each target's bytes times the ranks that hold a copy of each part."""
    from lazyload.errors import PlanError

    try:
        targets, items, seconds, mapping = rank_plan(directory, model, world, 0, plan)
    except PlanError as exc:
        return {"world": world, "plan": plan or "tp", "error": str(exc).split(";")[0]}
    ranks = range(world) if all_ranks else (0, world - 1)
    per_rank = [sum(i.nbytes for i in items)] + [
        sum(i.nbytes for i in rank_plan(directory, model, world, r, plan)[1]) for r in ranks if r]
    # The add-up check counts weights only: a scale block at a slice edge covers both neighbours.
    weights = [_weight_bytes(items)] + [_weight_bytes(rank_plan(directory, model, world, r, plan)[1])
                                        for r in ranks if r] if all_ranks else []
    out = {"world": world, "plan": plan or "tp", "seconds": seconds, "rank0_bytes": per_rank[0],
           "cpu_seconds": plan_cpu_seconds(directory, model, world, plan),
           "max_bytes": max(per_rank), "min_bytes": min(per_rank), "items": len(items),
           "unexpected": len(mapping.unexpected)}
    if all_ranks:
        from lazyload.formats import open_index, resolve

        index = open_index(resolve(directory))
        scales = {part.entry.key for i in items for part in i.reads()[1:]} | {
            k for k in index if k.endswith(("_scale_inv", "weight_scale", "_zero_point"))}
        expected = sum(_replicated_bytes(sum(index[k].nbytes for k in mapping.exprs[t.name].keys() if k not in scales),
                                         t.placement, world) for t in targets)
        out["adds_up"] = sum(weights) == expected
    return out


def pipeline_stage(model, stage, stages):
    """A copy of `model` cut down to pipeline stage `stage` of `stages`, as
    torch.distributed.pipelining's manual split makes one: its share of the layers (as
    even as the count allows), the others set to None in the ModuleList; the embedding
    only on the first stage, the final norm and the head only on the last."""
    import copy

    stage_model = copy.deepcopy(model)  # on meta: no data is copied
    inner = stage_model.model
    n = len(inner.layers)
    first, last = round(stage * n / stages), round((stage + 1) * n / stages)
    for i in range(n):
        if not first <= i < last:
            inner.layers[i] = None
    if stage > 0:
        inner.embed_tokens = None
    if stage < stages - 1:
        inner.norm = None
        stage_model.lm_head = None
    return stage_model


def measure_pipeline(directory, model, tp, stages):
    """TP x PP: each stage's TP rank 0 plan; the stages' bytes add up to TP rank 0's bytes
    of the whole model, and each stage reports the others' tensors, none unexpected."""
    whole = sum(i.nbytes for i in rank_plan(directory, model, tp, 0)[1])
    per_stage, seconds, unexpected = [], [], 0
    for stage in range(stages):
        _, items, secs, mapping = rank_plan(directory, pipeline_stage(model, stage, stages), tp, 0)
        per_stage.append(sum(i.nbytes for i in items))
        seconds.append(secs)
        unexpected += len(mapping.unexpected)
    return {"tp": tp, "stages": stages, "whole_bytes": whole, "stage_bytes": per_stage, "max_seconds": max(seconds),
            "unexpected": unexpected, "adds_up": sum(per_stage) == whole}


def _weight_bytes(items):
    return sum(item.reads()[0].nbytes for item in items)


def _replicated_bytes(full, p, world):
    """A target's checkpoint bytes summed over the ranks: each part once per rank holding it."""
    if p.kind == "replicate" or world == 1:
        return full * world
    if p.groups and p.groups < world:
        return full * (world // p.groups)
    return full


# --------------------------------------------------------------------------- isolated cases (fresh process)

def enter_cgroup(limit_bytes):
    """Move this process into a fresh memory cgroup (v1 or v2) limited to `limit_bytes`."""
    name = f"lazyload-scale-{os.getpid()}"
    for root, limit_file, procs in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "cgroup.procs"),
                                    ("/sys/fs/cgroup/unified", "memory.max", "cgroup.procs"),
                                    ("/sys/fs/cgroup", "memory.max", "cgroup.procs")):
        if not os.path.exists(os.path.join(root, limit_file if root.endswith("memory") else "cgroup.controllers")):
            continue
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(int(limit_bytes)))
            with open(os.path.join(path, procs), "w") as f:
                f.write(str(os.getpid()))
            return path
        except OSError:
            continue
    raise CaseSkipped("no memory cgroup could be made here (needs root and a cgroup v1 or v2 memory controller)")


def _share_bytes(args):
    import math

    import torch

    model = meta_model(args["ckpt_dir"])
    targets, _, _, _ = rank_plan(args["ckpt_dir"], model, args["world"], args["rank"], args.get("plan"))
    return model, sum(math.prod(t.local_shape) * torch.empty((), dtype=t.dtype).element_size() for t in targets)


def case_load(args, meter):
    """A rank's load_into inside a cgroup of destination + 2 GB."""
    from lazyload import LazyCheckpoint

    model, dest = _share_bytes(args)
    enter_cgroup(dest + args["headroom"])
    cpu0 = os.times()
    meter.start()
    report = LazyCheckpoint(args["ckpt_dir"]).load_into(model, args["rank"], args["world"], reader=args["reader"],
                                                         plan=args.get("plan"), progress=False)
    meter.loaded(model)
    cpu = os.times()
    meter.records["load"].update(kernel_s=cpu.system - cpu0.system, user_s=cpu.user - cpu0.user,
                                 rank_bytes=report.bytes_read + report.bytes_mapped, reader=report.reader,
                                 released=report.reader != "" and args.get("release", False))
    return model


class _Dests(object):
    """Stands in for a model in the meter: the destination tensors a case allocated."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def parameters(self):
        return self.tensors

    def buffers(self):
        return []

    def named_parameters(self):
        return []


def _destinations(targets):
    import torch

    return {t.name: torch.empty(t.local_shape, dtype=t.dtype) for t in targets}


def case_whole_file(args, meter):
    """DeepSpeed's way: each file the rank needs read whole (safetensors' load_file), its
    slices copied out, the file freed. Not in a cgroup: a file alone is larger than the
    headroom; its peak is the point."""
    from safetensors.torch import load_file

    from lazyload.placer import TensorDest

    model = meta_model(args["ckpt_dir"])
    targets, items, _, _ = rank_plan(args["ckpt_dir"], model, args["world"], args["rank"], args.get("plan"))
    by_file = {}
    for item in items:
        by_file.setdefault(item.entry.file, []).append(item)
    meter.start()
    dests = _destinations(targets)
    for path in sorted(by_file):
        tensors = load_file(path)
        for item in by_file[path]:
            source = tensors[item.entry.key][tuple(slice(a, b) for a, b in item.src_box)]
            TensorDest(dests[item.target]).place(item, source)
        del tensors
    result = _Dests(dests.values())
    meter.record("load", result)
    meter.records["load"]["rank_bytes"] = sum(os.path.getsize(f) for f in by_file)
    return result


def case_pread_pages(args, meter):
    """The physical reference: this rank's exact page-granular ranges, 8 threads of pread
    into reused 16 MiB buffers (nothing kept). What the storage and page cache can deliver."""
    from lazyload.readers import byte_runs
    from lazyload.system import PAGE

    model = meta_model(args["ckpt_dir"])
    _, items, _, _ = rank_plan(args["ckpt_dir"], model, args["world"], args["rank"], args.get("plan"))
    ranges = []
    for item in items:
        offsets, run = byte_runs(item)
        first, last = offsets // PAGE, (offsets + run - 1) // PAGE
        ranges += [(item.entry.file, a, b) for a, b in zip(first.tolist(), last.tolist())]
    merged = []
    for path, a, b in sorted(ranges):
        if merged and merged[-1][0] == path and a <= merged[-1][2] + 1:
            merged[-1][2] = max(merged[-1][2], b)
        else:
            merged.append([path, a, b])
    chunk = 16 << 20
    work = [(path, off, min(chunk, (b + 1) * PAGE - off)) for path, a, b in merged
            for off in range(a * PAGE, (b + 1) * PAGE, chunk)]
    meter.start()
    total = common.pread_ranges(work, 8, chunk)
    result = _Dests([])
    meter.record("load", result)
    meter.records["load"]["rank_bytes"] = total
    return result


# --------------------------------------------------------------------------- driver

def ensure_checkpoint(base, shape, layers=None):
    directory = os.path.join(base, shape + (f"-L{layers}" if layers else ""))
    if not os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        sparse_checkpoint.write(shape, directory, layers)
    return directory


def cold():
    reason = common.drop_page_cache()
    if reason:
        raise SystemExit(f"cold runs need the page cache dropped: {reason}")


def run_case(name, fn, args):
    cold()
    try:
        result = common.run_isolated(f"bench_scale:{fn}", args, timeout=args.get("timeout", 1800))
    except CaseSkipped as exc:
        return {"case": name, "skipped": str(exc)}
    except Exception as exc:  # a case killed by its cgroup is a result too
        return {"case": name, "failed": str(exc).strip().splitlines()[-1][:200]}
    return {"case": name} | result["records"]["load"]


def fmt_load_rows(rows):
    lines = ["| case | seconds | GB/s | rank bytes (GB) | peak RSS (GB) | peak anon above dest (MiB) | "
             "peak file-backed (GB) | kernel CPU s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['case']} | {r.get('skipped') or r.get('failed')} |||||||")
            continue
        anon = (r["peak_anon"] - r["baseline_anon"] - r["dest_bytes"]) / common.MiB
        lines.append(f"| {r['case']} | {r['seconds']:.1f} | {r['rank_bytes'] / GB / r['seconds']:.2f} | "
                     f"{r['rank_bytes'] / GB:.2f} | {r['peak_rss'] / GB:.2f} | {anon:,.0f} | "
                     f"{(r['peak_file'] - r['baseline_file']) / GB:.2f} | {r.get('kernel_s', float('nan')):.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "lazyload-sparse"),
                        help="where the sparse checkpoints are written (kept for reruns)")
    parser.add_argument("--shapes", default="llama-405b,deepseek-v3,llama4-maverick")
    parser.add_argument("--world", type=int, default=128, help="world of the rank whose share is loaded")
    parser.add_argument("--headroom", type=float, default=2.0, help="GB of cgroup above the destination")
    parser.add_argument("--readers", default="auto,pread")
    parser.add_argument("--skip-load", action="store_true", help="index and plan only")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        directory = ensure_checkpoint(args.dir, shape)
        model = meta_model(directory)
        print(f"\n## {shape}: {directory}\n")
        cold()
        index_cold = measure_index(directory)
        index_warm = measure_index(directory)
        print(f"index: {index_cold['tensors']:,} tensors in {index_cold['files']} files, "
              f"{index_cold['checkpoint_bytes'] / GB:,.1f} GB; headers {index_cold['header_bytes'] / 1e6:.1f} MB; "
              f"cold {index_cold['seconds']:.2f} s ({index_cold['storage_bytes'] / 1e6:.1f} MB from storage), "
              f"warm {index_warm['seconds']:.2f} s\n")
        moe = "experts" in " ".join(n for n, _ in model.named_parameters())
        lines = ["| world | plan | rank 0 plan s | plan CPU s | rank 0 GB | min-max GB/rank | read items | ranks add up |",
                 "|---|---|---|---|---|---|---|---|"]
        for world in (8, 64, 128):
            for plan in ([None, "ep"] if moe else [None]):
                r = measure_plan(directory, model, world, plan, all_ranks=world <= 8 or not moe)
                if "error" in r:
                    lines.append(f"| {world} | {r['plan']} | {r['error']} ||||||")
                    continue
                lines.append(f"| {world} | {r['plan']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
                             f"{r['rank0_bytes'] / GB:.2f} | "
                             f"{r['min_bytes'] / GB:.2f}-{r['max_bytes'] / GB:.2f} | {r['items']:,} | "
                             f"{ {True: 'yes', False: 'NO'}.get(r.get('adds_up'), '-')} |")
        print("\n".join(lines))
        if not moe:
            pp = measure_pipeline(directory, model, 8, 16)
            print(f"\nTP 8 x PP 16: stage rank-0 plans {min(pp['stage_bytes']) / GB:.2f}-{max(pp['stage_bytes']) / GB:.2f} "
                  f"GB, {pp['max_seconds']:.2f} s at most; sum {sum(pp['stage_bytes']) / GB:.2f} GB = TP 8 rank 0's "
                  f"{pp['whole_bytes'] / GB:.2f} GB: {'yes' if pp['adds_up'] else 'NO'}; unexpected {pp['unexpected']}")
        if args.skip_load:
            continue
        rows = []
        short = ensure_checkpoint(args.dir, shape, SHORT_LAYERS)
        for label, ckpt in ((f"{SHORT_LAYERS} layers", short), ("all layers", directory)):
            base = {"ckpt_dir": ckpt, "rank": 0, "world": args.world, "headroom": int(args.headroom * GB)}
            for reader in args.readers.split(","):
                rows.append(run_case(f"lazyload {reader}, {label}", "case_load", base | {"reader": reader}))
            rows.append(run_case(f"8-thread pread of the rank's pages, {label}", "case_pread_pages", base))
        rows.append(run_case(f"whole-file, {SHORT_LAYERS} layers", "case_whole_file",
                             {"ckpt_dir": short, "rank": 0, "world": args.world}))
        print(f"\nrank 0 of {args.world}, cold page cache; lazyload in a cgroup of destination + "
              f"{args.headroom:g} GB\n")
        print(fmt_load_rows(rows))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
