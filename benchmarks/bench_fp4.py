"""4-bit checkpoint load benchmark: the benchmark Llama (common.write_llama_checkpoint)
quantized and written by each format's own code, then loaded dequantized to bf16:

  compressed-tensors NVFP4   `nvfp4-pack-quantized` (ModelCompressor, tests/quant_checkpoints.py)
  compressed-tensors INT4    `pack-quantized` W4A16, group 32 (Kimi-K2's experts' layout)
  ModelOpt NVFP4             mtq.quantize(NVFP4_DEFAULT_CFG) + export_hf_checkpoint, on CPU

Rows per format (each in a fresh process, page cache warm, see common.run_isolated):
  lazyload                   LazyCheckpoint(dir).load_into(meta_model)  (bf16)
  lazyload kept packed       load_into(meta_model, quantize="keep"): compressed-tensors' bytes held as
                             stored in Packed4Linear (ModelOpt's NVFP4 is not kept: dequantized)
  transformers               from_pretrained(dir, dtype=bf16,
                             quantization_config=CompressedTensorsConfig(dequantize=True));
                             for ModelOpt's NVFP4 transformers has no loader of pre-quantized
                             checkpoints (its NVFP4 quantizer says so): the row is skipped.
The loaded values are compared by checksums of a few weights (the tests compare every weight).

Usage: python benchmarks/bench_fp4.py [--quick] [--formats nvfp4,int4,modelopt] [--ckpt-dir DIR]
"""

import argparse
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.join(os.path.dirname(BENCH_DIR), "tests"))  # the formats' checkpoint writers
import bench_load  # noqa: E402
import common  # noqa: E402
from common import CaseSkipped, MiB  # noqa: E402

FORMATS = {"nvfp4": ("compressed-tensors NVFP4", "NVFP4", None), "int4": ("compressed-tensors INT4 W4A16 g32",
                                                                          "W4A16", 32),
           "modelopt": ("ModelOpt NVFP4", None, None)}
DONE = "lazyload_bench_done"  # written last: a folder holding it is a finished checkpoint
CHECKED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight")


def case_lazyload(args, meter):
    return _lazyload(args, meter)


def _lazyload(args, meter, **options):
    import torch
    from lazyload import LazyCheckpoint
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock
    config = bench_load._config(args)
    meter.start()
    model = bench_load._meta_model(config, torch.bfloat16)
    LazyCheckpoint(args["ckpt_dir"]).load_into(model, progress=False, **options)
    meter.loaded(model)
    return model


def case_lazyload_keep(args, meter):
    if args["format"] == "modelopt":
        raise CaseSkipped("quantize='keep' holds compressed-tensors' NVFP4 / INT4; ModelOpt's NVFP4 (its "
                          "weight_scale_2 multiplies) is loaded dequantized")
    return _lazyload(args, meter, quantize="keep")


def case_transformers(args, meter):
    import torch
    from transformers import CompressedTensorsConfig, LlamaForCausalLM
    from transformers.utils import logging
    if args["format"] == "modelopt":
        raise CaseSkipped("transformers loads no pre-quantized NVFP4 checkpoint of ModelOpt (quant_method "
                          "'modelopt'): its NVFP4 quantizer only quantizes full-precision weights, on a CUDA GPU")
    logging.disable_progress_bar()
    meter.start()
    model = LlamaForCausalLM.from_pretrained(args["ckpt_dir"], dtype=torch.bfloat16,
                                             quantization_config=CompressedTensorsConfig(dequantize=True))
    meter.loaded(model)
    return model


def write_format(fmt, src, dst):
    """The bf16 checkpoint `src` written in `fmt` by the format's own code into `dst` (kept)."""
    import time
    from quant_checkpoints import write_ct_packed_checkpoint, write_modelopt_checkpoint

    if os.path.exists(os.path.join(dst, DONE)):
        return
    t0 = time.perf_counter()
    _, scheme, group = FORMATS[fmt]
    if fmt == "modelopt":
        write_modelopt_checkpoint(src, dst)
    else:
        write_ct_packed_checkpoint(src, dst, scheme, group, min_shards=4)
    open(os.path.join(dst, DONE), "w").close()
    print(f"wrote {dst} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def table(rows):
    lines = ["| format | loader | seconds | peak anon above start (MiB) | loaded weights (MiB) | checkpoint (MiB) | time vs "
             "transformers | peak vs transformers | same values |", "|---|---|---|---|---|---|---|---|---|"]
    for fmt, loader, rec, size, same in rows:
        tf = next((r for f, name, r, _, _ in rows if f == fmt and name == "transformers"), None)
        peak = rec["peak_anon"] - rec["baseline_anon"]
        lines.append(f"| {FORMATS[fmt][0]} | {loader} | {rec['seconds']:.2f} | {common.mib(peak)} "
                     f"| {common.mib(rec['dest_bytes'])} | {common.mib(size)} "
                     f"| {common.ratio(rec['seconds'], tf['seconds'] if tf else None)} "
                     f"| {common.ratio(peak, tf['peak_anon'] - tf['baseline_anon'] if tf else None)} | {same} |")
    return "\n".join(lines)


def run_format(fmt, directory, repeat):
    """(loader, record, checkpoint bytes, same values as transformers) rows of one format."""
    args = {"ckpt_dir": directory, "dtype": "bf16", "format": fmt, "checksum_names": list(CHECKED)}
    size = sum(os.path.getsize(f) for f in common.shard_files(directory))
    out, sums = [], {}
    for loader, case in (("lazyload", "case_lazyload"), ("lazyload kept packed", "case_lazyload_keep"),
                         ("transformers", "case_transformers")):
        try:
            runs = []
            for _ in range(repeat):
                common.warm_page_cache(directory)
                runs.append(common.run_isolated(f"bench_fp4:{case}", {**args, "checksum_names": []} if "keep" in case
                                                else args))
        except CaseSkipped as exc:
            print(f"- {FORMATS[fmt][0]}, {loader}: skipped: {exc}")
            continue
        sums[loader] = runs[0]["checksum"]
        out.append((loader, common.median_records(runs)["load"], size))
    compared = "lazyload" in sums and "transformers" in sums
    same = "-" if not compared else "yes" if sums["lazyload"] == sums["transformers"] else "NO"
    return [(loader, rec, size, same if loader != "lazyload kept packed" else "(packed)") for loader, rec, size in out]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the ~200 MB Llama instead of the full one")
    parser.add_argument("--ckpt-dir", default=None, help="the bf16 checkpoint (default: the cached benchmark Llama)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    shape = common.checkpoint_shape(quick=args.quick)
    src = common.write_llama_checkpoint(args.ckpt_dir or common.default_ckpt_dir(quick=args.quick), quick=args.quick)
    rows = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        directory = f"{src}_{fmt}"
        write_format(fmt, src, directory)
        rows += [(fmt, *row) for row in run_format(fmt, directory, args.repeat)]
    print(f"\n{src}: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, MLP "
          f"{shape['intermediate_size']}; loaded into bf16 on CPU; {bench_load.load_average()}\n")
    print(table(rows))
    print(f"\n(MiB = {MiB} bytes; peak anon above start: the process's anonymous memory at its peak during the "
          "load less before it, the loaded model included)")


if __name__ == "__main__":
    main()
