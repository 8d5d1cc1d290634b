"""Formats benchmark: per-rank loads of the same checkpoint from its original safetensors,
from pre-sharded copies (lazyload's layout, `save_sharded`) written for the load's world and
for another world, and by DeepSpeed's own `init_inference(checkpoint=...)`, in one run.

  original        LlamaForCausalLM on meta (bf16), LazyCheckpoint(original).load_into(model, rank, world)
  sharded-same    the same from the copy written for this world
  sharded-other   the same from the copy written for --other-world (split or merged on load)
  deepspeed       deepspeed.init_inference(meta model, tensor_parallel={"tp_size": world},
                  dtype=bf16, replace_with_kernel_inject=False, checkpoint=<json listing the
                  original's shards>): AutoTP; every rank loads every shard whole
  ds+lazyload     init_inference without checkpoint=, then load_into (the DeepSpeed user's change)

Every load is a `torchrun --standalone --nproc-per-node WORLD` job (gloo, CPU; DeepSpeed with
DS_ACCELERATOR=cpu); each rank measures itself. Per rank: seconds (model construction +
load), lazyload's own counter (bytes read + bytes left mapped: the rank's share), bytes read
from storage (/proc/self/io read_bytes: ~0 with the warm page cache used here), the peak of
file-backed pages mapped (the checkpoint pages a rank
touched through mmap), the peak anonymous memory above the baseline, and VmHWM. The writing
of each copy is measured too (seconds, peak anonymous memory: one layer of one rank).

Usage: python benchmarks/bench_formats.py [--quick] [--ckpt-dir DIR] [--out-dir DIR]
           [--world 2] [--other-world 4] [--loaders original,sharded-same,...] [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LOADERS = ["original", "sharded-same", "sharded-other", "deepspeed", "ds+lazyload"]


# --------------------------------------------------------------------------- one rank (under torchrun)

def _meta_model(ckpt_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(ckpt_dir)
    with common.default_dtype(torch.bfloat16), torch.device("meta"):
        return LlamaForCausalLM(config)


def _local_sum(model, name):
    import torch

    tensor = dict(model.named_parameters())[name].detach()
    tensor = tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor
    with torch.no_grad():
        return float(tensor.float().sum())


def worker(args):
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from lazyload import LazyCheckpoint

    hf_logging.set_verbosity_error()
    deepspeed_case = args.loader in ("deepspeed", "ds+lazyload")
    if deepspeed_case:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    source = {"original": args.ckpt_dir, "sharded-same": args.same, "sharded-other": args.other,
              "ds+lazyload": args.ckpt_dir}.get(args.loader)
    dist.barrier()
    meter = common.Meter()
    meter.start()
    report = None
    model = _meta_model(args.ckpt_dir)
    if deepspeed_case:
        kwargs = dict(checkpoint=args.ds_json) if args.loader == "deepspeed" else {}
        model = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.bfloat16,
                                         replace_with_kernel_inject=False, **kwargs).module
    if source is not None:
        report = LazyCheckpoint(source).load_into(model, rank, world, progress=False)
    meter.loaded(model)
    meter.sampler.stop()
    load = meter.records["load"]
    result = {"rank": rank, "seconds": load["seconds"], "rchar": load["rchar"], "read_bytes": load["read_bytes"],
              "peak_file": load["peak_file"] - load["baseline_file"],
              "peak_anon": load["peak_anon"] - load["baseline_anon"], "vmhwm": load["vmhwm"],
              "share": None if report is None else report.bytes_read + report.bytes_mapped,
              "q0": _local_sum(model, "model.layers.0.self_attn.q_proj.weight")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def reshard_child(src, out, world):
    """Write one pre-sharded copy in this process, measured."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline: the model is built inside)

    from lazyload import save_sharded

    meter = common.Meter()
    meter.start()
    save_sharded(src, out, world)
    meter.record("write", torch.nn.Module())
    meter.sampler.stop()
    print("BENCH_RESULT " + json.dumps(meter.records["write"]))


# --------------------------------------------------------------------------- driver (parent)

def write_copy(src, out, world):
    """The copy for `world` (written once, kept); its writing measured in a fresh process."""
    if os.path.isfile(os.path.join(out, "lazyload_sharded.json")):
        return None
    cmd = [sys.executable, os.path.abspath(__file__), "--reshard-child", src, out, str(world)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LAZYLOAD_PROGRESS="0"))
    line = next((line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"writing {out} failed:\n{proc.stderr[-4000:]}")
    return json.loads(line.removeprefix("BENCH_RESULT "))


def launch(loader, world, args, paths):
    common.warm_page_cache(args.ckpt_dir)
    for copy in (paths["same"], paths["other"]):
        common.warm_page_cache(copy)
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1", DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world),
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
    ranks, _ = common.torchrun_ranks(__file__, world, ["--loader", loader, "--ckpt-dir", args.ckpt_dir, "--same",
                                                       paths["same"], "--other", paths["other"], "--ds-json",
                                                       paths["ds_json"]], args.timeout, env)
    return sorted(ranks, key=lambda r: r["rank"])


def deepspeed_json(ckpt_dir, out_dir):
    """DeepSpeed's description of the original: its shards, whole-tensor state dicts."""
    path = os.path.join(out_dir, "ds_checkpoint.json")
    files = [os.path.abspath(str(f)) for f in common.shard_files(ckpt_dir)]
    with open(path, "w") as f:
        json.dump({"type": "ds_model", "checkpoints": files, "version": 1.0}, f)
    return path


def row(loader, ranks_runs, checkpoint_bytes):
    """Max over ranks of each figure, median over repeats. DeepSpeed loads every listed
    file whole on every rank: its share is the checkpoint."""
    def figure(key):
        return statistics.median(max(r[key] for r in ranks) for ranks in ranks_runs)
    shares = [r["share"] for r in ranks_runs[0]]
    share = common.mib(checkpoint_bytes) + " (every file)" if shares[0] is None else common.mib(max(shares))
    return (f"| {loader} | {figure('seconds'):.2f} | {share} | {common.mib(figure('read_bytes'))} | "
            f"{common.mib(figure('peak_file'))} | {common.mib(figure('peak_anon'))} | {common.mib(figure('vmhwm'))} | "
            f"{ranks_runs[0][0]['q0']:.4f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None, help="original checkpoint (written if missing)")
    parser.add_argument("--out-dir", default=None, help="where the pre-sharded copies go (default: beside it)")
    parser.add_argument("--quick", action="store_true", help="~200 MB checkpoint, for smoke tests")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--other-world", type=int, default=4)
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--loader", "--out", "--same", "--other", "--ds-json"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    if len(sys.argv) > 1 and sys.argv[1] == "--reshard-child":
        reshard_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.ckpt_dir = args.ckpt_dir or common.default_ckpt_dir(quick=args.quick)
    common.write_llama_checkpoint(args.ckpt_dir, quick=args.quick)
    out_dir = args.out_dir or args.ckpt_dir.rstrip("/") + "_formats"
    os.makedirs(out_dir, exist_ok=True)
    paths = {"same": os.path.join(out_dir, f"tp{args.world}"), "other": os.path.join(out_dir, f"tp{args.other_world}"),
             "ds_json": deepspeed_json(args.ckpt_dir, out_dir)}
    size = sum(os.path.getsize(f) for f in common.shard_files(args.ckpt_dir))
    print(f"checkpoint {args.ckpt_dir}: {common.mib(size)} MiB; load world {args.world}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("| copy written | for world | seconds | peak anon above baseline (MiB) |\n|---|---|---|---|")
    for key, world in (("same", args.world), ("other", args.other_world)):
        t0 = time.perf_counter()
        written = write_copy(args.ckpt_dir, paths[key], world)
        if written is not None:
            print(f"| {paths[key]} | {world} | {time.perf_counter() - t0:.1f} | "
                  f"{common.mib(written['peak_anon'] - written['baseline_anon'])} |")
        else:
            print(f"| {paths[key]} | {world} | (kept from an earlier run) | - |")
    print("\n| loader | seconds/rank | bytes read/rank (MiB) | from storage (MiB) | peak file-backed (MiB) | "
          "peak anon above baseline (MiB) | VmHWM (MiB) | rank 0 q_proj[0] sum |\n|---|---|---|---|---|---|---|---|")
    for loader in args.loaders.split(","):
        try:
            runs = [launch(loader, args.world, args, paths) for _ in range(args.repeat)]
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"| {loader} | failed: {str(exc).strip().splitlines()[-1][:200]} |")
            continue
        print(row(loader, runs, size))
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
