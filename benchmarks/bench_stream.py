"""Streaming engine benchmark: lazyload's readers against the peers and against the machine.

On a >= 4 GB bf16 Llama checkpoint (default 44 layers of the hidden-2048 shape, ~4.1 GB,
written once into common.default_ckpt_dir(44), under the system temp directory, or --ckpt-dir),
warm and cold page cache, each case in a fresh process
(common.run_isolated):

  lazyload mmap / pread   LazyCheckpoint(dir).load_into(meta model, reader=...)
  transformers            from_pretrained (parameters stay views of the mmap in the same
                          dtype: its "+touch" time, one byte read per page, is the fair one)
  accelerate              init_empty_weights + load_checkpoint_and_dispatch
  whole-file              safetensors load_file per shard, copy into a real model
  memcpy (warm)           physical reference: the files mapped, copied into one fresh
                          destination buffer of the same size
  pread x8 (cold)         physical reference: 8 threads pread every file in 16 MiB chunks
                          into a reused buffer each

Cold: the page cache is dropped, then every loader runs once on a small checkpoint (in its
own process) so that the libraries' pages are back: cold measures the checkpoint's storage.

Also: row-parallel read amplification (world 4, rank 0, o_proj/down_proj sharded on the
input dim): bytes asked of the kernel and bytes read from storage (cold) for the mmap
reader, pread with whole-span reads of short runs, and pread run by run.

Usage: python benchmarks/bench_stream.py [--layers 44] [--dtype bf16] [--cache warm,cold] [--repeat 3] [--quick]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_load  # noqa: E402  (the peers' cases)
import common  # noqa: E402
from common import CaseSkipped, MiB  # noqa: E402

DEFAULT_LAYERS = 44
SMALL_DIR = common.default_ckpt_dir(None, True)  # ~200 MB, for warming the libraries


# --------------------------------------------------------------------------- cases (in a child)

def case_lazyload(args, meter):
    import torch
    from lazyload import LazyCheckpoint, Placement

    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock, as the peers' cases do

    dtype = bench_load._torch_dtype(args)
    config = bench_load._config(args)
    meter.start()
    model = bench_load._meta_model(config, dtype)
    plan = None
    if args.get("world", 1) > 1:
        plan = {}
        for name, tensor in model.state_dict().items():
            if tensor.dim() == 2:
                row = "o_proj" in name or "down_proj" in name
                plan[name] = Placement("shard", 1 if row else 0)
    if args.get("short_run") is not None:
        import lazyload.readers.runs
        lazyload.readers.runs.SHORT_RUN = args["short_run"]
    report = LazyCheckpoint(args["ckpt_dir"]).load_into(
        model, args.get("rank", 0), args.get("world", 1), dtype=dtype, reader=args["reader"], plan=plan,
        progress=False, release_pages=args.get("release_pages", False))
    meter.loaded(model)
    meter.records["load"]["kernel_bytes"] = report.bytes_read
    del torch
    return model


def case_memcpy(args, meter):
    """The files mapped (warm), their tensor bytes copied into one fresh buffer."""
    import mmap

    import torch

    files = common.shard_files(args["ckpt_dir"])
    sizes = [os.path.getsize(f) for f in files]
    meter.start()
    dest = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for path, size in zip(files, sizes):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            src = torch.frombuffer(m, dtype=torch.uint8)
            dest[offset:offset + size].copy_(src)
            del src
        offset += size
    meter.record("load", _Bytes(dest))
    return _Bytes(dest)


def case_pread8(args, meter):
    """8 threads, each pread-ing 16 MiB chunks of the files into its own reused buffer."""
    files = common.shard_files(args["ckpt_dir"])
    chunk = 16 * MiB
    work = [(f, off, chunk) for f in files for off in range(0, os.path.getsize(f), chunk)]
    meter.start()
    result = _Bytes(None, common.pread_ranges(work, 8, chunk))
    meter.record("load", result)
    return result


class _Bytes:
    """Stands in for a model in the meter: dest_bytes of a plain buffer."""

    def __init__(self, tensor, nbytes=None):
        self.tensor = tensor
        self.nbytes = nbytes if nbytes is not None else tensor.numel()

    def parameters(self):
        return []

    def buffers(self):
        return [self.tensor] if self.tensor is not None else []

    def named_parameters(self):
        return []


CASES = {
    "lazyload auto": ("bench_stream:case_lazyload", {"reader": "auto"}),
    "lazyload mmap": ("bench_stream:case_lazyload", {"reader": "mmap"}),
    "lazyload pread": ("bench_stream:case_lazyload", {"reader": "pread"}),
    "transformers": ("bench_load:case_transformers", {}),
    "accelerate": ("bench_load:case_accelerate", {}),
    "whole-file": ("bench_load:case_whole_file", {}),
}


# --------------------------------------------------------------------------- driver

def case_warm_libraries(args, meter):
    """Run every loader once on the small checkpoint: after the page cache is dropped, this
    brings the libraries' pages (torch, transformers, lazyload) back, and only them."""
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    from lazyload import LazyCheckpoint

    small = args["small_dir"]
    meter.start()
    model = LlamaForCausalLM.from_pretrained(small, dtype=torch.bfloat16)
    config = model.config
    with init_empty_weights():
        load_checkpoint_and_dispatch(LlamaForCausalLM(config), small, device_map={"": "cpu"}, dtype=torch.bfloat16)
    for reader in ("mmap", "pread"):
        LazyCheckpoint(small).load_into(bench_load._meta_model(config, torch.bfloat16), reader=reader, progress=False)
    meter.loaded(model)
    return model


def run(fn, args, cache, ckpt_dir):
    """Warm: the checkpoint read once before. Cold: the page cache dropped, then the
    libraries (not the checkpoint) brought back by a run on another, small checkpoint,
    so that "cold" measures the checkpoint's storage, not python's imports."""
    if cache == "warm":
        common.warm_page_cache(ckpt_dir)
    else:
        failure = common.drop_page_cache()
        if failure:
            raise CaseSkipped(f"could not drop the page cache: {failure}")
        common.run_isolated("bench_stream:case_warm_libraries", {"small_dir": SMALL_DIR})
    return common.run_isolated(fn, args)


def table(rows, nbytes, physical):
    """rows: (name, record, touch record or None)."""
    lines = ["| loader | seconds | GB/s | vs physical | vs lazyload pread | peak RSS (MiB) "
             "| peak anon above baseline (MiB) | anon minus destination (MiB) | read from storage (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref = dict((n, r) for n, r, _ in rows).get("lazyload pread")
    for name, rec, touch in rows:
        seconds = rec["seconds"] if touch is None else touch["seconds"]
        label = name if touch is None else name + " (+touch)"
        rate = nbytes / seconds / 1e9
        anon = rec["peak_anon"] - rec["baseline_anon"]
        vs_phys = f"{rate / physical:.2f}x" if physical else "-"
        vs_ref = f"{seconds / ref['seconds']:.2f}x time" if ref else "-"
        lines.append(f"| {label} | {seconds:.2f} | {rate:.2f} | {vs_phys} | {vs_ref} | {rec['vmhwm'] / MiB:,.0f} "
                     f"| {anon / MiB:,.0f} | {(anon - rec['dest_bytes']) / MiB:,.0f} | {rec['read_bytes'] / MiB:,.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--quick", action="store_true", help="~200 MB checkpoint, a smoke test")
    parser.add_argument("--dtype", default="bf16", help="target dtype: bf16 (same as the checkpoint) or fp16")
    parser.add_argument("--cache", default="warm,cold")
    parser.add_argument("--loaders", default=",".join(CASES))
    parser.add_argument("--no-amplification", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the cases; the tables show medians")
    common.add_clean_flag(parser)
    args = parser.parse_args()
    layers = None if args.quick else args.layers
    ckpt_dir = args.ckpt_dir or common.default_ckpt_dir(layers, args.quick)
    common.write_llama_checkpoint(ckpt_dir, layers, args.quick)
    common.write_llama_checkpoint(SMALL_DIR, None, True)
    files = common.shard_files(ckpt_dir)
    nbytes = sum(os.path.getsize(f) for f in files)
    print(f"## lazyload streaming benchmark\n\ncheckpoint {ckpt_dir}: {len(files)} shards, {nbytes / 1e9:.2f} GB "
          f"bf16 -> {args.dtype}; {os.cpu_count()} CPUs; each case in a fresh process, "
          f"median of {args.repeat} interleaved rounds (a shared machine: compare within this run, as ratios); "
          "cold = checkpoint dropped from the page cache, libraries warm")
    caches = args.cache.split(",")
    if "cold" in caches and common.can_drop_page_cache():
        print(f"\ncold runs skipped: {common.can_drop_page_cache()}")
        caches.remove("cold")
    loaders = [n for n in args.loaders.split(",") if n in CASES]
    base = {"ckpt_dir": ckpt_dir, "dtype": args.dtype, "touch": True}
    one_layer = common.largest_layer_bytes(ckpt_dir, 2)
    for cache in caches:
        phys_name, phys_fn = ("memcpy", "bench_stream:case_memcpy") if cache == "warm" else \
            ("pread x8", "bench_stream:case_pread8")
        # Rounds interleave the cases, so that a slow spell of this shared machine hits
        # them all alike; the table shows each case's median over the rounds.
        runs = {name: [] for name in [phys_name] + loaders}
        for _ in range(args.repeat):
            runs[phys_name].append(run(phys_fn, base | {"touch": False}, cache, ckpt_dir))
            for name in loaders:
                fn, extra = CASES[name]
                try:
                    runs[name].append(run(fn, base | extra, cache, ckpt_dir))
                except (CaseSkipped, RuntimeError) as exc:
                    print(f"- {name}: {exc}")
        physical = common.median_records(runs[phys_name])["load"]
        phys_rate = nbytes / physical["seconds"] / 1e9
        rows = [(phys_name + " (physical)", physical, None)]
        for name in loaders:
            if not runs[name]:
                continue
            recs = common.median_records(runs[name])
            rows.append((name, recs["load"], None))
            if args.dtype == "bf16" and name != "accelerate" and name != "whole-file":
                # same dtype: these may leave views of the mapping, so also time them touched
                rows.append((name, recs["load"], recs["load+touch"]))
        print(f"\n### {cache} page cache, bf16 -> {args.dtype}\n")
        print(table(rows, nbytes, phys_rate))
        recs = {n: r for n, r, t in rows if t is None}
        for name in ("lazyload auto", "lazyload mmap", "lazyload pread"):
            if name in recs:
                over = recs[name]["peak_anon"] - recs[name]["baseline_anon"] - recs[name]["dest_bytes"]
                print(f"\n- {name}: {nbytes / recs[name]['seconds'] / 1e9:.2f} GB/s = "
                      f"{nbytes / recs[name]['seconds'] / 1e9 / phys_rate:.0%} of {phys_name} "
                      f"({phys_rate:.2f} GB/s); anon above destination {over / MiB:,.0f} MiB "
                      f"(one layer {one_layer / MiB:,.0f} MiB)")
    if not args.no_amplification and "cold" in caches:
        amplification(ckpt_dir, args.dtype)
    if args.clean:
        common.remove_checkpoint(ckpt_dir)
        common.remove_checkpoint(SMALL_DIR)


def amplification(ckpt_dir, dtype):
    print("\n### row-parallel read amplification: world 4, rank 0, cold page cache\n")
    print("| reader | seconds | slice bytes (MiB) | bytes asked of the kernel (MiB) | read from storage (MiB) |")
    print("|---|---|---|---|---|")
    slice_bytes = None
    for label, extra in (("mmap (get_slice)", {"reader": "mmap"}),
                         ("pread, whole spans for short runs", {"reader": "pread"}),
                         ("pread, run by run", {"reader": "pread", "short_run": 0})):
        args = {"ckpt_dir": ckpt_dir, "dtype": dtype, "world": 4, "rank": 0} | extra
        rec = run("bench_stream:case_lazyload", args, "cold", ckpt_dir)["records"]["load"]
        if slice_bytes is None:
            slice_bytes = rec["kernel_bytes"]
        kernel = "(page faults)" if extra["reader"] == "mmap" else f"{rec['kernel_bytes'] / MiB:,.0f}"
        print(f"| {label} | {rec['seconds']:.2f} | {slice_bytes / MiB:,.0f} | {kernel} | {rec['read_bytes'] / MiB:,.0f} |")


if __name__ == "__main__":
    main()
