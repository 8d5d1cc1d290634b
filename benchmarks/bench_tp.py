"""Tensor-parallel load benchmark: lazyload against transformers' tp_plan="auto", per rank.

For each world size (default 1, 2, 4, 8) and loader, one `torchrun --standalone
--nproc-per-node WORLD` job (gloo, CPU): every rank is its own process and measures itself.

  lazyload      LlamaForCausalLM(config) on the meta device (bf16), then
                LazyCheckpoint(dir).load_into(model, rank, world, progress=False)
                (under the process group this makes the model tensor parallel: DTensor)
  transformers  LlamaForCausalLM.from_pretrained(dir, dtype=torch.bfloat16, tp_plan="auto")

Per rank: seconds (model construction + load), seconds after touching one byte of every
4 KiB page of its local tensors ("+touch": mmap views are paid for there), lazyload's
report.bytes_read, /proc/self/io read_bytes (from storage: ~0 with a warm page cache),
peak RssFile / RssAnon above the baseline (sampled every 5 ms) and VmHWM (exact, absolute).

Page cache: "warm" reads every shard before each job; "cold" drops the page cache before
each job (root). In a cold job the ranks share one page cache, so a page read from storage
by one rank is free for the others: per-rank read_bytes depends on who came first.

OMP_NUM_THREADS is set to max(1, cpus // world) for every job (torchrun would give 1 thread
to every rank of a multi-process job and leave world 1 with all cores).

CPU s/rank is the rank's user + system time during the load: the work each rank does,
which falls with 1/world even where the ranks outnumber the cores (their wall time cannot).

Usage: python benchmarks/bench_tp.py [--quick] [--worlds 1,2,4,8] [--loaders lazyload,transformers]
                                     [--cache warm,cold] [--repeat 3] [--ckpt-dir DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402

LOADERS = ["lazyload", "transformers"]
CPUS = os.cpu_count() or 1


# --------------------------------------------------------------------------- one rank (under torchrun)

def _local(tensor):
    return tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor


def touch_local_pages(model):
    """One byte per 4 KiB page of every local parameter/buffer (DTensors: the local shard)."""
    import torch
    total = 0
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            flat = _local(tensor.detach()).reshape(-1).view(torch.uint8)
            total += int(flat[::common.PAGE].sum())
    return total


def local_bytes(model):
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        t = _local(tensor.detach())
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def local_checksums(model, names):
    import torch
    params = dict(model.named_parameters())
    with torch.no_grad():
        return {n: float(_local(params[n].detach()).float().sum()) for n in names if n in params}


def worker(args):
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    from lazyload import LazyCheckpoint

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig.from_pretrained(args.ckpt_dir)
    dist.barrier()  # every rank imported and ready: start together

    import resource

    meter = common.Meter()
    meter.start()  # collects garbage first: not the load's CPU time
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    report = None
    if args.loader == "lazyload":
        with common.default_dtype(torch.bfloat16), torch.device("meta"):
            model = LlamaForCausalLM(config)
        report = LazyCheckpoint(args.ckpt_dir).load_into(model, rank, world, progress=False)
    else:
        model = LlamaForCausalLM.from_pretrained(args.ckpt_dir, dtype=torch.bfloat16, tp_plan="auto")
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    meter.loaded(model)
    touch_local_pages(model)
    meter.record("load+touch", model)
    meter.sampler.stop()
    result = {
        "rank": rank, "world": world,
        "load": meter.records["load"], "touch": meter.records["load+touch"],
        "local_bytes": local_bytes(model),
        "cpu_s": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime,
        "report": None if report is None else {
            "bytes_read": report.bytes_read, "bytes_mapped": report.bytes_mapped, "seconds": report.seconds, "peak_rss": report.peak_rss,
            "peak_anon": report.peak_anon, "reader": report.reader, "ok": report.ok},
        "checksum": local_checksums(model, args.checksum_names.split(",")),
        "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver (parent)

def checksum_names(num_layers):
    return ["model.layers.0.self_attn.q_proj.weight", f"model.layers.{num_layers - 1}.mlp.down_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.norm.weight"]


def launch(loader, world, cache, args, num_layers):
    """One torchrun job; returns the per-rank results sorted by rank."""
    if cache == "warm":
        common.warm_page_cache(args.ckpt_dir)
    else:
        failure = common.drop_page_cache()
        if failure:
            raise RuntimeError(f"could not drop the page cache: {failure}")
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(max(1, CPUS // world)),
               TOKENIZERS_PARALLELISM="false")
    ranks, wall = common.torchrun_ranks(__file__, world, ["--loader", loader, "--ckpt-dir", args.ckpt_dir,
                                                          "--checksum-names", ",".join(checksum_names(num_layers))],
                                        args.timeout, env)
    return sorted(ranks, key=lambda r: r["rank"]), wall


def summarize(ranks):
    """Per-rank figures of one job: medians and maxima over the ranks."""
    def col(fn):
        return [fn(r) for r in ranks]
    secs = col(lambda r: r["load"]["seconds"])
    touch = col(lambda r: r["touch"]["seconds"])
    anon = col(lambda r: r["load"]["peak_anon"] - r["load"]["baseline_anon"])
    return {
        "median_s": statistics.median(secs), "max_s": max(secs),
        "median_touch_s": statistics.median(touch), "max_touch_s": max(touch),
        "median_cpu_s": statistics.median(col(lambda r: r["cpu_s"])),
        # this rank's share: bytes copied out plus bytes left as views of the mapping
        "report_read": [r["report"]["bytes_read"] + r["report"]["bytes_mapped"] for r in ranks]
        if ranks[0]["report"] else None,
        "storage_read": col(lambda r: r["touch"]["read_bytes"]),
        "file_peak": max(col(lambda r: r["touch"]["peak_file"] - r["touch"]["baseline_file"])),
        "anon_peak": max(anon),
        "anon_over_local": max(a - r["local_bytes"] for a, r in zip(anon, ranks)),
        "vmhwm": max(col(lambda r: r["touch"]["vmhwm"])),
        "local_bytes": max(col(lambda r: r["local_bytes"])),
        "dtensors": ranks[0]["dtensors"],
        "checksums": [r["checksum"] for r in ranks],
    }


def merge_repeats(summaries):
    """One job's figures per (world, loader) from repeated jobs: the median of every scalar;
    per-rank lists and checksums from the first job."""
    merged = dict(summaries[0])
    for key, value in merged.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(s[key] for s in summaries)
    return merged


def _span(values):
    """median (min-max) of per-rank byte counts, in MiB."""
    if not values:
        return "-"
    lo, hi, med = min(values), max(values), statistics.median(values)
    return common.mib(med) if hi - lo < MiB else f"{common.mib(med)} ({common.mib(lo)}-{common.mib(hi)})"


def format_table(results):
    header = ("| world | loader | median s/rank | max s/rank | time vs lazyload | median s/rank +touch "
              "| +touch vs lazyload | CPU s/rank | report read+mapped/rank (MiB) | storage read_bytes/rank (MiB) "
              "| peak file-backed/rank (MiB) | peak anon/rank (MiB) | anon minus local shard (MiB) "
              "| VmHWM/rank (MiB) | anon vs lazyload | VmHWM vs lazyload |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for world in sorted({w for w, _ in results}):
        ref = results.get((world, "lazyload"))
        for loader in LOADERS:
            s = results.get((world, loader))
            if s is None:
                continue
            if isinstance(s, str):
                lines.append(f"| {world} | {loader} | failed: {s} |" + " |" * 14)
                continue
            r = ref if isinstance(ref, dict) else None
            lines.append(
                f"| {world} | {loader} | {s['median_s']:.2f} | {s['max_s']:.2f} | {common.ratio(s['median_s'], r and r['median_s'])} "
                f"| {s['median_touch_s']:.2f} | {common.ratio(s['median_touch_s'], r and r['median_touch_s'])} "
                f"| {s['median_cpu_s']:.2f} | {_span(s['report_read'])} | {_span(s['storage_read'])} | {common.mib(s['file_peak'])} "
                f"| {common.mib(s['anon_peak'])} | {common.mib(s['anon_over_local'])} | {common.mib(s['vmhwm'])} "
                f"| {common.ratio(s['anon_peak'], r and r['anon_peak'])} | {common.ratio(s['vmhwm'], r and r['vmhwm'])} |")
    return "\n".join(lines)


def check_checksums(results):
    """Both loaders must give every rank the same numbers for the compared (sharded) tensors."""
    for world in sorted({w for w, _ in results}):
        a, b = results.get((world, "lazyload")), results.get((world, "transformers"))
        if not (isinstance(a, dict) and isinstance(b, dict)):
            continue
        bad = [(rank, k) for rank, (ca, cb) in enumerate(zip(a["checksums"], b["checksums"]))
               for k in ca if abs(ca[k] - cb.get(k, float("nan"))) > 1e-3 * max(1.0, abs(ca[k]))]
        print(f"- world {world}: local shards of {len(a['checksums'][0])} tensors on every rank "
              + ("agree between the loaders" if not bad else f"**DIFFER**: {bad[:4]}"))


def print_targets(results, total_bytes):
    base = results.get((1, "lazyload"))
    for world in sorted({w for w, _ in results}):
        lazy, tf = results.get((world, "lazyload")), results.get((world, "transformers"))
        if not isinstance(lazy, dict):
            continue
        notes = []
        if isinstance(base, dict) and world > 1:
            ideal = base["median_s"] / world
            ok = lazy["median_s"] <= 1.5 * ideal
            notes.append(f"time {lazy['median_s']:.2f} s vs world-1/{world} = {ideal:.2f} s "
                         f"(speedup {base['median_s'] / lazy['median_s']:.2f}x of {world}x) -> "
                         f"**{'PASS' if ok else 'FAIL'}** (within 1.5x of 1/world)")
        if isinstance(base, dict) and world > 1:
            notes.append(f"CPU {lazy['median_cpu_s']:.2f} s/rank = {lazy['median_cpu_s'] / base['median_cpu_s']:.2f} "
                         f"of world 1's (1/world = {1 / world:.3f})")
        if lazy["report_read"]:
            per_rank = max(lazy["report_read"])
            notes.append(f"bytes read+mapped/rank {per_rank / MiB:,.0f} MiB = {per_rank / total_bytes:.3f} of the "
                         f"checkpoint (1/world = {1 / world:.3f})")
        if isinstance(tf, dict):
            for key, label in (("median_s", "time"), ("median_touch_s", "time +touch")):
                ok = lazy[key] <= tf[key]
                notes.append(f"{label} {lazy[key]:.2f} s vs transformers {tf[key]:.2f} s -> **{'PASS' if ok else 'FAIL'}**")
        if world > CPUS:
            notes.append(f"CPU-bound: {world} ranks share {CPUS} CPUs, so per-rank seconds include waiting for a core")
        print(f"- world {world}: " + "; ".join(notes))


def load_average():
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {CPUS} CPUs"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None, help=f"checkpoint (written if missing); default "
                        f"{common.DEFAULT_CKPT_DIR}[_quick]")
    parser.add_argument("--quick", action="store_true", help="~200 MB checkpoint, for smoke tests")
    parser.add_argument("--worlds", default="1,2,4,8")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--cache", default="warm,cold", help="warm, cold or both (cold needs root)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per torchrun job")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of jobs; the table shows medians")
    # worker side (set by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loader", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--checksum-names", default="", help=argparse.SUPPRESS)
    common.add_clean_flag(parser)
    args = parser.parse_args()
    args.ckpt_dir = args.ckpt_dir or common.default_ckpt_dir(None, args.quick)
    return args


def main():
    args = parse_args()
    if args.worker:
        worker(args)
        return
    common.write_llama_checkpoint(args.ckpt_dir, quick=args.quick)
    config = json.load(open(os.path.join(args.ckpt_dir, "config.json")))
    num_layers = config["num_hidden_layers"]
    files = common.shard_files(args.ckpt_dir)
    total = sum(os.path.getsize(f) for f in files)
    worlds = [int(w) for w in args.worlds.split(",")]
    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    caches = [c for c in ("warm", "cold") if c in args.cache.split(",")]
    if "cold" in caches and common.can_drop_page_cache():
        print(f"cold runs skipped: {common.can_drop_page_cache()}")
        caches.remove("cold")
    print(f"## lazyload tensor-parallel load benchmark\n\ncheckpoint {args.ckpt_dir}: {len(files)} shards, "
          f"{total / 1e9:.2f} GB bf16, {num_layers} layers, hidden {config['hidden_size']}, "
          f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} KV heads; torchrun (gloo, CPU), "
          f"one process per rank; {load_average()}", flush=True)
    if max(worlds) > CPUS:
        print(f"\nNote: worlds above {CPUS} run more ranks than this machine has CPUs: those jobs are CPU-bound "
              "(ranks take turns on the cores), so their per-rank seconds do not show 1/world scaling.", flush=True)
    for cache in caches:
        print(f"\n### {cache} page cache, one job per (world, loader) and round, median of {args.repeat} "
              "interleaved rounds\n", flush=True)
        jobs = {}
        for _ in range(args.repeat):
            for world in worlds:
                for loader in loaders:
                    if isinstance(jobs.get((world, loader)), str):
                        continue  # failed before
                    try:
                        ranks, wall = launch(loader, world, cache, args, num_layers)
                        s = summarize(ranks)
                        jobs.setdefault((world, loader), []).append(s)
                        print(f"- {loader} world {world}: median {s['median_s']:.2f} s/rank, max {s['max_s']:.2f} s, "
                              f"{s['dtensors']} DTensor parameters; job wall {wall:.0f} s (startup included)", flush=True)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        jobs[(world, loader)] = str(exc).splitlines()[0][:120]
                        print(f"- {loader} world {world}: FAILED: {str(exc)[-3000:]}", flush=True)
        results = {key: v if isinstance(v, str) else merge_repeats(v) for key, v in jobs.items()}
        print()
        print(format_table(results))
        print("\nper-rank columns: median/max over the ranks of a job for seconds; memory columns are the worst "
              "rank; byte columns are median (min-max) over ranks. Ratios: this row / the lazyload row of the same "
              "world. Local shard = this rank's parameter/buffer bytes after the load.\n")
        check_checksums(results)
        print_targets(results, total)
    print(f"\nat the end: {load_average()}")
    if args.clean:
        common.remove_checkpoint(args.ckpt_dir)


if __name__ == "__main__":
    main()
