"""GPU check of the streaming engine, in one short run (< 5 minutes on an H200).

1. Writes a ~1.3 GB bf16 Llama-shaped checkpoint (hidden 2048, 12 layers) to local disk
   (once; --ckpt-dir, default under the system temp directory, see common.default_ckpt_dir).
2. Loads it on the CPU (pread reader): the reference, bf16 and bf16 -> fp16.
3. Loads it to CUDA with the pread reader (pinned staging, a CUDA stream per worker, raw
   bytes copied over PCIe then cast on the device), bf16 and bf16 -> fp16, and checks every
   parameter and buffer equals the CPU result exactly.
4. Prints the H2D rate of those loads against a plain pinned copy of the same number of
   bytes (`tensor.to("cuda", non_blocking=True)`), measured in the same run.

Without CUDA it says so and exits 0; `--cpu-smoke` then runs the CPU pieces (checkpoint,
reference loads, comparison code) on a small checkpoint, to keep this script working.

Usage: python benchmarks/gpu_check.py [--layers 12] [--ckpt-dir DIR] [--cpu-smoke]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GB = 1e9


def meta_model(ckpt_dir, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(ckpt_dir)
    with common.default_dtype(dtype), torch.device("meta"):
        return LlamaForCausalLM(config)


def load(ckpt_dir, dtype, device):
    """(state_dict, non-persistent buffers, seconds, report)."""
    import torch
    from lazyload import LazyCheckpoint

    model = meta_model(ckpt_dir, dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = LazyCheckpoint(ckpt_dir).load_into(model, device=device, dtype=dtype, reader="pread", progress=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    state = dict(model.state_dict())
    computed = {n: b for n, b in model.named_buffers() if n not in state}  # rotary inv_freq: recomputed
    return state, computed, seconds, report


def compare(got, want, where):
    """Every tensor equal (same dtype, shape, values); returns the list of problems."""
    import torch

    problems = []
    if sorted(got) != sorted(want):
        problems.append(f"{where}: names differ: {sorted(set(got) ^ set(want))[:5]}")
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{where}: {name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a.cpu(), b.cpu()):
            problems.append(f"{where}: {name}: values differ")
    return problems


def compare_computed(got, want, where):
    """Buffers the model computes (not read from the checkpoint): equal up to rounding,
    since the GPU may compute them a last bit differently."""
    import torch

    return [f"{where}: buffer {n} differs beyond rounding" for n in want
            if n not in got or not torch.allclose(got[n].cpu().float(), want[n].cpu().float(), rtol=1e-6, atol=0)]


def pinned_copy_rate(nbytes, repeat=3):
    """GB/s of one pinned host buffer of `nbytes` copied to the GPU (best of `repeat`)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        del dev
    return nbytes / best / GB


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None, help="default: common.default_ckpt_dir(layers)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cpu-smoke", action="store_true", help="without CUDA: run the CPU pieces on a small checkpoint")
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device here; nothing to check (run with --cpu-smoke to exercise the CPU pieces).")
        return 0
    quick = not cuda
    ckpt_dir = common.default_ckpt_dir(None, True) if quick else args.ckpt_dir or common.default_ckpt_dir(args.layers)
    common.write_llama_checkpoint(ckpt_dir, None if quick else args.layers, quick)
    files = common.shard_files(ckpt_dir)
    nbytes = sum(os.path.getsize(f) for f in files)
    common.warm_page_cache(ckpt_dir)
    print(f"checkpoint {ckpt_dir}: {len(files)} shards, {nbytes / GB:.2f} GB bf16, page cache warm")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}")

    problems, rows = [], []
    for name, dtype in (("bf16", torch.bfloat16), ("bf16->fp16", torch.float16)):
        reference, ref_computed, cpu_s, _ = load(ckpt_dir, dtype, "cpu")
        rows.append((f"lazyload pread -> cpu, {name}", cpu_s, nbytes))
        if not cuda:
            again, computed, _, _ = load(ckpt_dir, dtype, "cpu")
            problems += compare(again, reference, f"cpu {name} (smoke)")
            problems += compare_computed(computed, ref_computed, f"cpu {name} (smoke)")
            continue
        load(ckpt_dir, dtype, "cuda")  # warm-up: CUDA context, kernels, pinned allocator
        state, computed, gpu_s, report = load(ckpt_dir, dtype, "cuda")
        devices = {t.device.type for t in list(state.values()) + list(computed.values())}
        if devices != {"cuda"}:
            problems.append(f"cuda {name}: tensors left on {devices - {'cuda'}}")
        problems += compare(state, reference, f"cuda {name}")
        problems += compare_computed(computed, ref_computed, f"cuda {name}")
        rows.append((f"lazyload pread -> cuda, {name}", gpu_s, report.bytes_read))
        del state, reference, computed
        torch.cuda.empty_cache()

    if cuda:
        rate = pinned_copy_rate(nbytes)
        rows.append(("plain pinned .to('cuda', non_blocking=True)", nbytes / rate / GB, nbytes))
    print("\n| load | seconds | GB/s | vs pinned copy |\n|---|---|---|---|")
    for label, seconds, n in rows:
        gbs = n / seconds / GB
        vs = f"{gbs / rate:.2f}x" if cuda else "-"
        print(f"| {label} | {seconds:.2f} | {gbs:.2f} | {vs} |")
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems[:20]))
        return 1
    print("\nOK: every tensor equals the CPU load" + ("" if cuda else " (CPU smoke only: no CUDA here)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
