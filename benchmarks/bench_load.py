"""Core loader benchmark: lazyload against the loaders it replaces, on one machine, in one run.

Loaders (each case in a fresh process, see common.run_isolated):
  lazyload      LazyCheckpoint(dir).load_into(meta_model, dtype=..., progress=False)
  transformers  LlamaForCausalLM.from_pretrained(dir, dtype=...)
  accelerate    init_empty_weights() + load_checkpoint_and_dispatch(model, dir, device_map={"": "cpu"}, dtype=...)
  whole-file    safetensors.torch.load_file per shard, copy (with cast) into a real model, delete

Every loader is also reported "+touch": after the load, one byte of every 4 KiB page of every
parameter is read. In the same dtype on CPU, from_pretrained keeps parameters as views of the
mmap, so its plain load time does not include reading the weights; the +touch rows do.

Usage: python benchmarks/bench_load.py [--quick] [--layers N] [--cases bf16,fp16] [--repeat 3]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import CaseSkipped, MiB  # noqa: E402

LOADERS = ["lazyload", "transformers", "accelerate", "whole-file"]
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
WARM_READ_LIMIT = 64 * MiB  # a warm run reading more than this from storage was not warm


# --------------------------------------------------------------------------- cases (run in a child)

def _torch_dtype(args):
    import torch
    return getattr(torch, DTYPE_NAMES[args["dtype"]])


def _config(args):
    from transformers import LlamaConfig
    return LlamaConfig.from_pretrained(args["ckpt_dir"])


def _meta_model(config, dtype):
    import torch
    from transformers import LlamaForCausalLM
    with common.default_dtype(dtype), torch.device("meta"):
        return LlamaForCausalLM(config)


def _empty_model(config, dtype):
    """accelerate's init_empty_weights model: parameters on meta, buffers real."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM
    with common.default_dtype(dtype), init_empty_weights():
        return LlamaForCausalLM(config)


def case_lazyload(args, meter):
    try:
        from lazyload import LazyCheckpoint
    except ImportError as exc:
        raise CaseSkipped(f"lazyload is not importable ({exc})")
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock, as in the other cases
    dtype, config = _torch_dtype(args), _config(args)
    meter.start()
    model = _meta_model(config, dtype)
    LazyCheckpoint(args["ckpt_dir"]).load_into(model, dtype=dtype, progress=False)
    meter.loaded(model)
    return model


def case_transformers(args, meter):
    from transformers import LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    dtype = _torch_dtype(args)
    meter.start()
    model = LlamaForCausalLM.from_pretrained(args["ckpt_dir"], dtype=dtype)
    meter.loaded(model)
    return model


def case_accelerate(args, meter):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch  # noqa: F401  before the clock
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock
    dtype, config = _torch_dtype(args), _config(args)
    meter.start()
    model = load_checkpoint_and_dispatch(_empty_model(config, dtype), args["ckpt_dir"], device_map={"": "cpu"},
                                         dtype=dtype)
    meter.loaded(model)
    return model


def case_whole_file(args, meter):
    import torch
    from accelerate import init_empty_weights  # noqa: F401  imported before the clock
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock
    dtype, config = _torch_dtype(args), _config(args)
    meter.start()
    model = _empty_model(config, dtype)  # parameters on meta, buffers (rotary) real
    buffers = dict(model.named_buffers())
    model.to_empty(device="cpu")  # the destination, allocated
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        params = dict(model.named_parameters())
        for path in common.shard_files(args["ckpt_dir"]):
            state = load_file(path)
            for key, tensor in state.items():
                params[key].copy_(tensor)
            del state
    meter.loaded(model)
    return model


CASE_FUNCTIONS = {
    "lazyload": "bench_load:case_lazyload",
    "transformers": "bench_load:case_transformers",
    "accelerate": "bench_load:case_accelerate",
    "whole-file": "bench_load:case_whole_file",
}


# --------------------------------------------------------------------------- driver (parent)

def checksum_names(num_layers):
    return ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            f"model.layers.{num_layers - 1}.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"]


def prepare_cache(cache):
    """Warm: read every shard. Cold: drop the page cache. Returns None or why it failed."""
    if cache == "warm":
        common.warm_page_cache(ARGS.ckpt_dir)
        return None
    return common.drop_page_cache()


def run_loader(loader, dtype_name, cache, repeat, num_layers):
    """Median records of ``repeat`` fresh-process runs, and the checksum of the first."""
    args = {"ckpt_dir": ARGS.ckpt_dir, "dtype": dtype_name, "touch": True,
            "checksum_names": checksum_names(num_layers)}
    results = []
    for _ in range(repeat):
        results.append(run_once(loader, args, cache))
    return common.median_records(results), results[0]["checksum"]


def run_once(loader, args, cache, tries=3):
    """One fresh-process run. A warm run that still read from storage (something else on
    the machine dropped the page cache meanwhile) is redone, at most ``tries`` times."""
    for attempt in range(1, tries + 1):
        failure = prepare_cache(cache)
        if failure:
            raise CaseSkipped(f"could not drop the page cache: {failure}")
        result = common.run_isolated(CASE_FUNCTIONS[loader], args)
        read = result["records"]["load"]["read_bytes"]
        if cache != "warm" or read <= WARM_READ_LIMIT:
            return result
        print(f"- note: warm run of {loader} read {read / MiB:,.0f} MiB from storage "
              f"(page cache dropped by another process?), try {attempt} of {tries}", flush=True)
    return result


def check_checksums(checksums):
    """Loaders of the same case must load the same numbers."""
    items = list(checksums.items())
    for name, sums in items[1:]:
        ref_name, ref = items[0]
        bad = [k for k in ref if k not in sums or abs(ref[k] - sums[k]) > 1e-3 * max(1.0, abs(ref[k]))]
        if bad:
            print(f"**WARNING**: {name} loaded different values than {ref_name} for {bad}")


def print_targets(rows, one_layer):
    """The issue's targets, checked on the warm runs."""
    recs = dict(rows)
    lazy, tf = recs.get("lazyload"), recs.get("transformers")
    if lazy is None:
        print("targets: not checked (lazyload was skipped)")
        return
    if tf is not None:
        ok = lazy["seconds"] <= tf["seconds"]
        print(f"- lazyload time <= from_pretrained time: {lazy['seconds']:.2f} s vs {tf['seconds']:.2f} s "
              f"-> **{'PASS' if ok else 'FAIL'}**")
        lt, tt = recs.get("lazyload+touch"), recs.get("transformers+touch")
        if lt and tt:
            ok = lt["seconds"] <= tt["seconds"]
            print(f"- with +touch: {lt['seconds']:.2f} s vs {tt['seconds']:.2f} s -> **{'PASS' if ok else 'FAIL'}**")
    over = lazy["peak_anon"] - lazy["baseline_anon"] - lazy["dest_bytes"]
    limit = one_layer + 64 * MiB
    print(f"- lazyload peak anon above destination <= one layer + 64 MiB: {over / MiB:,.0f} MiB "
          f"vs {limit / MiB:,.0f} MiB (one layer {one_layer / MiB:,.0f} MiB) "
          f"-> **{'PASS' if over <= limit else 'FAIL'}**")


def format_table(rows, reference="lazyload"):
    """Markdown table. ``rows``: list of (loader name, record); record as in ``Meter.record``.

    Ratios compare each row against the row named ``reference`` (``reference+touch`` for
    rows ending in ``+touch``) from the same run.
    """
    by_name = dict(rows)
    header = ("| loader | seconds | time vs lazyload | peak anon above baseline (MiB) "
              "| peak anon minus destination (MiB) | peak file-backed above baseline (MiB) "
              "| VmHWM (MiB) | anon vs lazyload | read from storage (MiB) |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, rec in rows:
        ref = by_name.get(reference + ("+touch" if name.endswith("+touch") else ""))
        anon = rec["peak_anon"] - rec["baseline_anon"]
        ref_anon = ref["peak_anon"] - ref["baseline_anon"] if ref else None
        lines.append(
            f"| {name} | {rec['seconds']:.2f} | {common.ratio(rec['seconds'], ref and ref['seconds'])} "
            f"| {common.mib(anon)} | {common.mib(anon - rec['dest_bytes'])} "
            f"| {common.mib(rec['peak_file'] - rec['baseline_file'])} | {common.mib(rec['vmhwm'])} "
            f"| {common.ratio(anon, ref_anon)} | {common.mib(rec['read_bytes'])} |")
    return "\n".join(lines)


def run_case(dtype_name, cache, loaders, num_layers):
    title = f"bf16 -> {dtype_name}, {cache} page cache, median of {ARGS.repeat}"
    print(f"\n### {title}\n", flush=True)
    records, checksums = {}, {}
    for loader in loaders:
        try:
            records[loader], checksums[loader] = run_loader(loader, dtype_name, cache, ARGS.repeat, num_layers)
        except CaseSkipped as exc:
            print(f"- {loader}: skipped: {exc}", flush=True)
    if not records:
        return
    rows = [(name, recs["load"]) for name, recs in records.items()]
    rows += [(name + "+touch", recs["load+touch"]) for name, recs in records.items()]
    print(format_table(rows))
    first = next(iter(records.values()))["load"]
    print(f"\ndestination {first['dest_bytes'] / MiB:,.0f} MiB; baseline before load: "
          f"RSS {first['baseline_rss'] / MiB:,.0f} MiB, anon {first['baseline_anon'] / MiB:,.0f} MiB, "
          f"file {first['baseline_file'] / MiB:,.0f} MiB (VmHWM is absolute, the rest above baseline)\n")
    check_checksums(checksums)
    if cache == "warm":
        print_targets(rows, common.largest_layer_bytes(ARGS.ckpt_dir, ITEMSIZE[dtype_name]))


def load_average():
    """Other work on the machine skews every row: say how busy it was."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint directory (written if missing); "
                        f"default {common.DEFAULT_CKPT_DIR}[_L<layers>|_quick]")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 22: ~2.2 GB; 44: ~4.1 GB)")
    parser.add_argument("--quick", action="store_true", help="tiny ~200 MB checkpoint, for smoke tests")
    parser.add_argument("--cases", default="bf16,fp16", help="target dtypes, comma separated: bf16,fp16,fp32")
    parser.add_argument("--loaders", default=",".join(LOADERS), help="comma separated subset of " + ",".join(LOADERS))
    parser.add_argument("--cache", default="warm,cold", help="warm, cold or both (cold drops the page cache: root)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the table shows medians")
    common.add_clean_flag(parser)
    args = parser.parse_args()
    args.ckpt_dir = args.ckpt_dir or common.default_ckpt_dir(args.layers, args.quick)
    return args


def main():
    global ARGS
    ARGS = parse_args()
    common.write_llama_checkpoint(ARGS.ckpt_dir, ARGS.layers, ARGS.quick)
    shape = common.checkpoint_shape(ARGS.layers, ARGS.quick)
    files = common.shard_files(ARGS.ckpt_dir)
    size = sum(os.path.getsize(f) for f in files)
    print(f"## lazyload core loader benchmark\n\ncheckpoint {ARGS.ckpt_dir}: {len(files)} shards, "
          f"{size / 1e9:.2f} GB bf16, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}; "
          f"python {sys.version.split()[0]}; {load_average()}")
    # Warm runs first: a cold run leaves the libraries out of the page cache too.
    caches = [c for c in ("warm", "cold") if c in ARGS.cache.split(",")]
    if "cold" in caches:
        failure = common.can_drop_page_cache()
        if failure:
            print(f"\ncold runs skipped: could not drop the page cache ({failure})")
            caches.remove("cold")
    loaders = [name.strip() for name in ARGS.loaders.split(",") if name.strip()]
    for cache in caches:
        for dtype_name in ARGS.cases.split(","):
            run_case(dtype_name.strip(), cache, loaders, shape["num_hidden_layers"])
    print(f"\nat the end: {load_average()}")
    if ARGS.clean:
        common.remove_checkpoint(ARGS.ckpt_dir)


ARGS = None

if __name__ == "__main__":
    main()
