"""Dequantizing load benchmark: the benchmark Llama written as an FP8 checkpoint with 128x128
block scales (DeepSeek-V3's layout), loaded into a bf16 model, against the bf16 -> fp16
cast load of the bf16 checkpoint and transformers' own CPU dequantization
(`from_pretrained` of the FP8 checkpoint, which dequantizes without a GPU), in one run.

Rows (each in a fresh process, page cache warm, see common.run_isolated):
  lazyload fp8 -> bf16          LazyCheckpoint(fp8_dir).load_into(meta_model, dtype=bf16)
  lazyload fp8 -> bf16, pread   the same with reader="pread"
  lazyload bf16 -> fp16 (cast)  LazyCheckpoint(bf16_dir).load_into(meta_model, dtype=fp16)
  transformers fp8 -> bf16      LlamaForCausalLM.from_pretrained(fp8_dir, dtype=bf16)

Quantization on load (`--rows` picks; all by default), each in a fresh process as well:
  lazyload bf16 -> bf16          the plain load, the reference for bytes and time
  lazyload bf16 -> int8 / fp8    load_into(meta_model, quantize="int8" / "fp8")
  lazyload fp8 kept              the FP8 checkpoint, load_into(meta_model, quantize="fp8")
  lazyload bf16 -> nvfp4 / mxfp4 / int4 g32
                                 load_into(meta_model, quantize=...): 4 bits kept packed (Packed4Linear)
  transformers bf16 -> int8      from_pretrained(bf16_dir, quantization_config=TorchAoConfig(
                                 Int8WeightOnlyConfig(granularity=PerGroup(128))))
Weight bytes: the destination's parameters, torchao tensors as their int8 data + scales.

Every dim of the benchmark Llama is a multiple of 128, where transformers' dequantization is
exact too: the loaded values are compared. A last check loads a small FP8 Llama with an MLP
of 1000 (not a multiple of 128) with both, against the exact formula.

Forward time and weight memory of each holder (`--forward`: this table only), on the bf16
checkpoint, all in one process, one holder loaded at a time, inference mode:
  bf16 nn.Linear                 load_into(meta_model) of the bf16 checkpoint, the reference
  lazyload int8 / fp8            QuantizedLinear: dequantizes its whole weight in every call
  torchao int8 / fp8             Quantization(..., torchao=True): Int8Tensor / Float8Tensor weights
  transformers FP8Linear         from_pretrained of the FP8 checkpoint (Triton / DeepGEMM kernels:
                                 a CUDA device only; skipped with the reason elsewhere)
Per token: a batch of one, `--prompt` tokens in one call (prefill), and one token (the
weight-bound decode regime, no KV cache), medians of `--repeat` calls after a warm-up.

Usage: python benchmarks/bench_quant.py [--quick] [--ckpt-dir DIR] [--fp8-dir DIR] [--repeat 3]
       python benchmarks/bench_quant.py --forward [--quick] [--device cpu] [--prompt 128] [--repeat 5]
"""

import argparse
import json
import os
import sys
import tempfile

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.join(os.path.dirname(BENCH_DIR), "tests"))  # the FP8 checkpoint writer
import bench_load  # noqa: E402
import common  # noqa: E402
from common import CaseSkipped, MiB  # noqa: E402

GB = 1e9


def case_lazyload_pread(args, meter):
    from lazyload import LazyCheckpoint
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock
    dtype, config = bench_load._torch_dtype(args), bench_load._config(args)
    meter.start()
    model = bench_load._meta_model(config, dtype)
    LazyCheckpoint(args["ckpt_dir"]).load_into(model, dtype=dtype, reader="pread", progress=False)
    meter.loaded(model)
    return model


def weight_bytes(model):
    """(bytes the model's parameters hold, bytes of its quantized weights with their scales,
    those weights' bytes in bf16); torchao tensors count as their 8-bit data and scales."""
    import torch
    total = quantized = as_bf16 = 0
    params = dict(model.named_parameters())
    for name, p in params.items():
        if any(name.endswith(end) and name.removesuffix(end) in params
               for end in ("_scale", "_scale_inv", "_global_scale")):
            continue  # counted with its weight
        per = 1
        if hasattr(p, "qdata"):  # torchao
            data, scale = p.qdata, p.scale
        elif p.dtype in (torch.int8, torch.float8_e4m3fn):  # lazyload's X, X_scale; transformers' FP8 X_scale_inv
            data, scale = p, params.get(name + "_scale", params.get(name + "_scale_inv"))
        elif p.dtype in (torch.uint8, torch.int32) and name + "_scale" in params:  # Packed4Linear: 2 or 8 a word
            data, scale, per = p, params[name + "_scale"], 2 if p.dtype == torch.uint8 else 8
            quantized += params[name + "_global_scale"].nbytes if name + "_global_scale" in params else 0
        else:
            total += p.numel() * p.element_size()
            continue
        quantized += data.nbytes + scale.nbytes
        as_bf16 += 2 * data.numel() * per
    return total + quantized, quantized, as_bf16


def _record_bytes(meter, model):
    rec = meter.records["load"]
    rec["dest_bytes"], rec["quantized_bytes"], rec["quantized_bf16_bytes"] = weight_bytes(model)


def case_lazyload_quantize(args, meter):
    from lazyload import LazyCheckpoint
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the clock
    dtype, config = bench_load._torch_dtype(args), bench_load._config(args)
    meter.start()
    model = bench_load._meta_model(config, dtype)
    LazyCheckpoint(args["ckpt_dir"]).load_into(model, quantize=args["quantize"], progress=False)
    meter.loaded(model)
    _record_bytes(meter, model)
    return model


def case_transformers_torchao(args, meter):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, PerGroup
    except ImportError as exc:
        raise CaseSkipped(f"torchao is not installed ({exc})")
    from transformers import LlamaForCausalLM, TorchAoConfig
    from transformers.utils import logging
    logging.disable_progress_bar()
    meter.start()
    model = LlamaForCausalLM.from_pretrained(args["ckpt_dir"], dtype=bench_load._torch_dtype(args),
                                             quantization_config=TorchAoConfig(Int8WeightOnlyConfig(granularity=PerGroup(128))))
    meter.loaded(model)
    _record_bytes(meter, model)
    return model


def quant_table(recs):
    """Quantize-on-load rows against the bf16 load: seconds, peak anon over the destination,
    weight bytes, and the targets."""
    base, tf = recs.get("lazyload bf16 -> bf16"), recs.get("transformers bf16 -> int8 (torchao)")
    lines = ["| case | seconds | weight bytes (MiB) | vs bf16 bytes | quantized weights + scales vs their bf16 "
             "| peak anon above the loaded model (MiB) | time vs transformers int8 |", "|---|---|---|---|---|---|---|"]
    for name, rec in recs.items():
        share = rec["quantized_bytes"] / rec["quantized_bf16_bytes"] if rec.get("quantized_bf16_bytes") else None
        lines.append(f"| {name} | {rec['seconds']:.2f} | {common.mib(rec['dest_bytes'])} "
                     f"| {common.ratio(rec['dest_bytes'], base['dest_bytes'] if base else None)} "
                     f"| {'-' if share is None else f'{share:.3f}x'} | {common.mib(rec['peak_anon'] - rec['end_anon'])} "
                     f"| {common.ratio(rec['seconds'], tf['seconds'] if tf else None)} |")
    return "\n".join(lines)


def write_fp8(bf16_dir, fp8_dir, shape):
    """The bf16 benchmark checkpoint as FP8 blocks (kept: the marker says it is complete)."""
    from quant_checkpoints import write_fp8_checkpoint

    if common.checkpoint_is_complete(fp8_dir, shape):
        return
    write_fp8_checkpoint(bf16_dir, fp8_dir)
    files = {os.path.basename(f): os.path.getsize(f) for f in common.shard_files(fp8_dir)}
    with open(os.path.join(fp8_dir, common.MARKER), "w") as f:
        json.dump({"shape": shape, "files": files}, f, indent=1)


def run(fn_name, ckpt_dir, dtype, warm_dirs, num_layers, checksum=True, **extra):
    names = bench_load.checksum_names(num_layers) if checksum else []  # quantized rows: no float sums
    args = {"ckpt_dir": ckpt_dir, "dtype": dtype, "checksum_names": names, **extra}
    results = []
    for _ in range(ARGS.repeat):
        for d in warm_dirs:
            common.warm_page_cache(d)
        results.append(common.run_isolated(fn_name, args))
    return common.median_records(results)["load"], results[0]["checksum"]


def table(rows, ckpt_bytes, reference):
    header = ("| case | checkpoint (MiB) | seconds | GB/s read | GB/s written | peak anon above baseline (MiB) "
              "| peak anon minus destination (MiB) | peak anon above the loaded model (MiB) | time vs transformers |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, rec in rows:
        anon = rec["peak_anon"] - rec["baseline_anon"]
        size = ckpt_bytes[name]
        lines.append(f"| {name} | {common.mib(size)} | {rec['seconds']:.2f} | {size / rec['seconds'] / GB:.2f} "
                     f"| {rec['dest_bytes'] / rec['seconds'] / GB:.2f} | {common.mib(anon)} "
                     f"| {common.mib(anon - rec['dest_bytes'])} | {common.mib(rec['peak_anon'] - rec['end_anon'])} "
                     f"| {common.ratio(rec['seconds'], reference)} |")
    return "\n".join(lines)


def targets(recs, one_layer):
    fp8, cast, tf = recs.get("lazyload fp8 -> bf16"), recs.get("lazyload bf16 -> fp16 (cast)"), \
        recs.get("transformers fp8 -> bf16")
    if fp8 is None:
        return
    # Above what the loaded model holds in anonymous memory: its bf16 embeddings stay views
    # of the file mapping (not anonymous), so the destination's bytes would undercount it.
    over = fp8["peak_anon"] - fp8["end_anon"]
    print(f"- peak anon above the loaded model <= one layer: {over / MiB:,.0f} MiB vs one bf16 layer "
          f"{one_layer / MiB:,.0f} MiB -> **{'PASS' if over <= one_layer else 'FAIL'}**")
    if tf is not None:
        ok = fp8["seconds"] <= tf["seconds"]
        print(f"- time <= transformers': {fp8['seconds']:.2f} s vs {tf['seconds']:.2f} s "
              f"-> **{'PASS' if ok else 'FAIL'}**")
    if cast is not None:
        # Same model written: seconds per destination byte; the FP8 load reads half the bytes.
        slower = fp8["seconds"] / cast["seconds"]
        print(f"- FP8 -> bf16 within 1.5x of the bf16 -> fp16 cast load (same destination bytes): "
              f"{slower:.2f}x -> **{'PASS' if slower <= 1.5 else 'FAIL'}**")


def check_values(checksums):
    ref_name = "lazyload fp8 -> bf16"
    ref = checksums.get(ref_name)
    for name, sums in checksums.items():
        if ref is None or name == ref_name or "fp8" not in name:
            continue
        bad = [k for k in ref if sums.get(k) != ref[k]]
        print(f"- {name} loaded {'different values for ' + str(bad) if bad else 'the same values'} as {ref_name}")


def tail_blocks_check():
    """A small FP8 Llama with an MLP of 1000: each loader's largest error against the exact
    formula, relative to the quantization error (dequantized vs the original weights)."""
    import torch
    import transformers
    from checkpoints import build_model, reference_model, write_checkpoint
    from quant_checkpoints import dequantize, write_fp8_checkpoint
    from safetensors.torch import load_file
    from lazyload import LazyCheckpoint

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        src, config = write_checkpoint("llama", "bf16", os.path.join(tmp, "bf16"), hidden_size=256,
                                       intermediate_size=1000, num_hidden_layers=1, min_shards=1)
        fp8 = write_fp8_checkpoint(src, os.path.join(tmp, "fp8"))
        raw, orig = {}, {}
        for f in sorted(os.listdir(fp8)):
            if f.endswith(".safetensors"):
                raw.update(load_file(os.path.join(fp8, f)))
                orig.update(load_file(os.path.join(src, f)))
        key = "model.layers.0.mlp.down_proj.weight"
        exact = dequantize(raw[key], raw[key + "_scale_inv"], (128, 128), torch.bfloat16).float()
        quant_err = (exact - orig[key].float()).abs().max().item()
        model = build_model("llama", config, torch.bfloat16)
        LazyCheckpoint(str(fp8)).load_into(model, progress=False)
        lazy_err = (model.get_parameter(key).float() - exact).abs().max().item()
        try:
            tf_err = (reference_model("llama", fp8, torch.bfloat16).get_parameter(key).float() - exact).abs().max()
            tf_cell = f"{tf_err.item():.3g} ({tf_err.item() / quant_err:.1f}x the quantization error)"
        except Exception as exc:  # transformers refusing it is an answer too
            tf_cell = f"refused: {type(exc).__name__}: {str(exc)[:120]}"
    print(f"\n### MLP of 1000 (tail blocks of 1000 - 896 = 104 columns)\n\n"
          f"largest error of `{key}` against the exact formula; quantization error {quant_err:.3g}\n\n"
          f"| loader | largest error |\n|---|---|\n| lazyload | {lazy_err:.3g} |\n| transformers | {tf_cell} |")


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None, help="the bf16 checkpoint (written if missing); "
                        f"default {common.DEFAULT_CKPT_DIR}[_L<layers>|_quick]")
    parser.add_argument("--fp8-dir", default=None, help="its FP8 version (written if missing); default <ckpt-dir>_fp8")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="the ~200 MB checkpoint, for smoke tests")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the table shows medians")
    parser.add_argument("--rows", default="lazyload fp8 -> bf16,lazyload fp8 -> bf16 pread,"
                        "lazyload bf16 -> fp16 (cast),transformers fp8 -> bf16")
    parser.add_argument("--quant-rows", default=",".join(QUANT_CASES), help="quantize-on-load rows ('' for none)")
    parser.add_argument("--forward", action="store_true", help="only the forward table of each weight holder")
    parser.add_argument("--device", default="cpu", help="--forward: the device the holders run on")
    parser.add_argument("--prompt", type=int, default=128, help="--forward: tokens of the prefill call")
    ARGS = parser.parse_args()
    ckpt_dir = ARGS.ckpt_dir or common.default_ckpt_dir(ARGS.layers, ARGS.quick)
    fp8_dir = ARGS.fp8_dir or ckpt_dir.rstrip("/") + "_fp8"
    shape = common.checkpoint_shape(ARGS.layers, ARGS.quick)
    common.write_llama_checkpoint(ckpt_dir, ARGS.layers, ARGS.quick)
    if ARGS.forward:
        return forward_table(ckpt_dir, fp8_dir, shape)
    write_fp8(ckpt_dir, fp8_dir, shape)
    sizes = {d: sum(os.path.getsize(f) for f in common.shard_files(d)) for d in (ckpt_dir, fp8_dir)}
    print(f"## lazyload dequantizing load benchmark\n\nbf16 checkpoint {ckpt_dir}: {sizes[ckpt_dir] / GB:.2f} GB; "
          f"FP8 checkpoint {fp8_dir}: {sizes[fp8_dir] / GB:.2f} GB; {shape['num_hidden_layers']} layers, "
          f"hidden {shape['hidden_size']}; page cache warm, median of {ARGS.repeat}; {bench_load.load_average()}\n")
    cases = {
        "lazyload fp8 -> bf16": ("bench_load:case_lazyload", fp8_dir, "bf16"),
        "lazyload fp8 -> bf16 pread": ("bench_quant:case_lazyload_pread", fp8_dir, "bf16"),
        "lazyload bf16 -> fp16 (cast)": ("bench_load:case_lazyload", ckpt_dir, "fp16"),
        "transformers fp8 -> bf16": ("bench_load:case_transformers", fp8_dir, "bf16"),
    }
    recs, checksums, ckpt_bytes = {}, {}, {}
    for name in ARGS.rows.split(","):
        fn_name, directory, dtype = cases[name.strip()]
        try:
            recs[name], checksums[name] = run(fn_name, directory, dtype, [directory], shape["num_hidden_layers"])
            ckpt_bytes[name] = sizes[directory]
        except CaseSkipped as exc:
            print(f"- {name}: skipped: {exc}")
    tf = recs.get("transformers fp8 -> bf16")
    print(table(list(recs.items()), ckpt_bytes, tf["seconds"] if tf else None))
    first = next(iter(recs.values()))
    print(f"\ndestination {first['dest_bytes'] / MiB:,.0f} MiB; GB/s read: checkpoint bytes per second; "
          "GB/s written: destination bytes per second; the loaded model: its anonymous memory at the end "
          "(tensors left as views of the files are not anonymous)\n")
    check_values(checksums)
    targets(recs, common.largest_layer_bytes(ckpt_dir, 2))
    quant_rows(ckpt_dir, fp8_dir, shape)
    tail_blocks_check()
    print(f"\nat the end: {bench_load.load_average()}")


QUANT_CASES = {  # name -> (case, checkpoint: "bf16" or "fp8", quantize)
    "lazyload bf16 -> bf16": ("bench_load:case_lazyload", "bf16", None),
    "lazyload bf16 -> int8": ("bench_quant:case_lazyload_quantize", "bf16", "int8"),
    "lazyload bf16 -> fp8": ("bench_quant:case_lazyload_quantize", "bf16", "fp8"),
    "lazyload fp8 kept": ("bench_quant:case_lazyload_quantize", "fp8", "fp8"),
    "lazyload bf16 -> nvfp4": ("bench_quant:case_lazyload_quantize", "bf16", "nvfp4"),
    "lazyload bf16 -> mxfp4": ("bench_quant:case_lazyload_quantize", "bf16", "mxfp4"),
    "lazyload bf16 -> int4 g32": ("bench_quant:case_lazyload_quantize", "bf16", "int4:g32"),
    "transformers bf16 -> int8 (torchao)": ("bench_quant:case_transformers_torchao", "bf16", None),
}


def quant_rows(ckpt_dir, fp8_dir, shape):
    names = [n.strip() for n in ARGS.quant_rows.split(",") if n.strip()]
    if not names:
        return
    recs = {}
    for name in names:
        fn_name, which, quantize = QUANT_CASES[name]
        directory = fp8_dir if which == "fp8" else ckpt_dir
        extra = {"quantize": quantize} if quantize else {}
        try:
            recs[name], _ = run(fn_name, directory, "bf16", [directory], shape["num_hidden_layers"], False, **extra)
        except CaseSkipped as exc:
            print(f"- {name}: skipped: {exc}")
    print("\n### Quantization on load\n")
    print(quant_table(recs))
    one_layer = common.largest_layer_bytes(ckpt_dir, 2)
    tf = recs.get("transformers bf16 -> int8 (torchao)")
    for name in ("lazyload bf16 -> int8", "lazyload bf16 -> fp8", "lazyload fp8 kept", "lazyload bf16 -> nvfp4",
                 "lazyload bf16 -> mxfp4", "lazyload bf16 -> int4 g32"):
        rec = recs.get(name)
        if rec is None:
            continue
        # Above what the loaded model holds: bf16 embeddings stay views of the file (not anonymous).
        over = rec["peak_anon"] - rec["end_anon"]
        print(f"- {name}: peak anon above the loaded model {over / MiB:,.0f} MiB vs one bf16 layer "
              f"{one_layer / MiB:,.0f} MiB -> **{'PASS' if over <= one_layer else 'FAIL'}**", end="")
        share = rec["quantized_bytes"] / rec["quantized_bf16_bytes"]
        bound = 0.285 if name.endswith(("nvfp4", "mxfp4", "int4 g32")) else 0.55  # 4 bits: 0.53-0.56 bytes a param
        print(f"; quantized weights + scales {share:.3f}x their bf16 bytes -> **{'PASS' if share <= bound else 'FAIL'}**",
              end="")
        if tf and "fp8" not in name:
            print(f"; {rec['seconds']:.2f} s vs transformers {tf['seconds']:.2f} s "
                  f"-> **{'PASS' if rec['seconds'] <= tf['seconds'] else 'FAIL'}**", end="")
        print()


FORWARD_HOLDERS = {  # name -> quantize= of load_into (None: bf16); "transformers": from_pretrained of the FP8 copy
    "bf16 nn.Linear": None,
    "lazyload int8 QuantizedLinear": "int8",
    "lazyload fp8 QuantizedLinear": "fp8",
    "torchao int8 Int8Tensor": ("int8", True),
    "torchao fp8 Float8Tensor": ("fp8", True),
    "transformers FP8Linear": "transformers",
}


def load_holder(quantize, ckpt_dir, fp8_dir, shape, device):
    """The benchmark Llama in bf16 with its Linear weights held as `quantize` says."""
    import torch
    from lazyload import ArgumentError, LazyCheckpoint, Quantization

    if quantize == "transformers":
        if torch.device(device).type != "cuda":
            raise CaseSkipped("transformers' FP8Linear runs its Triton / DeepGEMM FP8 kernels on a CUDA GPU only")
        from transformers import LlamaForCausalLM
        write_fp8(ckpt_dir, fp8_dir, shape)
        return LlamaForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16, device_map=device)
    if isinstance(quantize, tuple):
        try:
            quantize = Quantization(quantize[0], torchao=True)
        except ArgumentError as exc:
            raise CaseSkipped(f"torchao is not installed ({exc})")
    model = bench_load._meta_model(bench_load._config({"ckpt_dir": ckpt_dir}), torch.bfloat16)
    LazyCheckpoint(ckpt_dir).load_into(model, device=device, quantize=quantize, progress=False)
    return model.eval()


def seconds_per_call(model, ids, repeat):
    """Median wall seconds of model(ids), after one warm-up call."""
    import statistics
    import time
    import torch

    times = []
    with torch.inference_mode():
        for i in range(repeat + 1):
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def forward_table(ckpt_dir, fp8_dir, shape):
    import torch

    print(f"## Forward per token of each weight holder\n\n{ckpt_dir}: {shape['num_hidden_layers']} layers, hidden "
          f"{shape['hidden_size']}, MLP {shape['intermediate_size']}; device {ARGS.device}, {torch.get_num_threads()} "
          f"threads, batch 1, median of {ARGS.repeat}; {bench_load.load_average()}\n")
    lines = [f"| holder | weight bytes (MiB) | vs bf16 | prefill ms/token ({ARGS.prompt} tokens) | vs bf16 "
             "| decode ms/token (1 token) | vs bf16 |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (1, ARGS.prompt), generator=g).to(ARGS.device)
    base = None
    for name, quantize in FORWARD_HOLDERS.items():
        try:
            model = load_holder(quantize, ckpt_dir, fp8_dir, shape, ARGS.device)
        except CaseSkipped as exc:
            print(f"- {name}: skipped: {exc}")
            continue
        row = (weight_bytes(model)[0], seconds_per_call(model, ids, ARGS.repeat) / ARGS.prompt * 1e3,
               seconds_per_call(model, ids[:, :1], ARGS.repeat) * 1e3)
        base = base or row
        lines.append(f"| {name} | {common.mib(row[0])} | {common.ratio(row[0], base[0])} | {row[1]:.3f} "
                     f"| {common.ratio(row[1], base[1])} | {row[2]:.2f} | {common.ratio(row[2], base[2])} |")
        del model
    print("\n".join(lines))


ARGS = None

if __name__ == "__main__":
    main()
