"""DCP benchmark: the benchmark Llama saved by torch.distributed.checkpoint (`dcp.save`,
FileSystemWriter, one process: one chunk per tensor) and loaded at world 1 and world 4 by

  lazyload    LlamaForCausalLM on meta (bf16), LazyCheckpoint(dcp_dir).load_into(model, rank, world)
              (under torchrun's gloo group: a tensor-parallel DTensor model, each rank reading its boxes)
  dcp.load    the same model made real (to_empty), at world > 1 made tensor parallel with
              transformers' Llama styles (colwise q/k/v/gate/up, rowwise o/down) on a 1-D mesh,
              then torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=dcp_dir)

Every load is a `torchrun --standalone --nproc-per-node WORLD` job (gloo, CPU, warm page
cache); each rank measures itself: seconds (model construction + load), bytes it read
(lazyload's own count, bytes read + bytes left mapped; and /proc/self/io rchar, the bytes
of read syscalls, which misses pages touched through a mapping), peak anonymous memory above
the baseline. The table gives the max over ranks.

Usage: python benchmarks/bench_dcp.py [--quick] [--ckpt-dir DIR] [--worlds 1,4] [--loaders lazyload,dcp.load]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LOADERS = ["lazyload", "dcp.load"]
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _meta_model(config_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(config_dir)
    with common.default_dtype(torch.bfloat16), torch.device("meta"):
        return LlamaForCausalLM(config)


def _dcp_load(model, dcp_dir, world):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model.to_empty(device="cpu")
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        styles = {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel() for name in ROWWISE}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, styles)
    dcp.load(model.state_dict(), checkpoint_id=dcp_dir)


def worker(args):
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from lazyload import LazyCheckpoint

    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    meter = common.Meter()
    meter.start()
    model = _meta_model(args.ckpt_dir)
    share = None
    if args.loader == "lazyload":
        report = LazyCheckpoint(args.dcp_dir).load_into(model, rank, world, progress=False)
        share = report.bytes_read + report.bytes_mapped
    else:
        _dcp_load(model, args.dcp_dir, world)
    meter.loaded(model)
    meter.sampler.stop()
    load = meter.records["load"]
    result = {"rank": rank, "seconds": load["seconds"], "rchar": load["rchar"], "share": share,
              "peak_anon": load["peak_anon"] - load["baseline_anon"]}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def write_dcp(ckpt_dir, dcp_dir):
    """The safetensors benchmark Llama saved by dcp.save (written once, kept)."""
    if os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        return
    code = ("import sys, torch.distributed.checkpoint as dcp; sys.path.insert(0, sys.argv[3]); import bench_dcp; "
            "from lazyload import LazyCheckpoint; m = bench_dcp._meta_model(sys.argv[1]); "
            "LazyCheckpoint(sys.argv[1]).load_into(m, progress=False); "
            "dcp.save({k: v.contiguous() for k, v in m.state_dict().items()}, checkpoint_id=sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, ckpt_dir, dcp_dir, common.BENCH_DIR], check=True,
                   env=dict(os.environ, LAZYLOAD_PROGRESS="0"))


def launch(loader, world, args):
    common.warm_page_cache(args.dcp_dir)
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
    ranks, _ = common.torchrun_ranks(__file__, world, ["--loader", loader, "--ckpt-dir", args.ckpt_dir,
                                                       "--dcp-dir", args.dcp_dir], args.timeout, env)
    return ranks


def row(loader, world, ranks, total):
    share = max((r["share"] for r in ranks if r["share"] is not None), default=None)
    return (f"| {loader} | {world} | {max(r['seconds'] for r in ranks):.2f} | "
            f"{common.mib(max(r['peak_anon'] for r in ranks))} | {'-' if share is None else common.mib(share)} | "
            f"{common.mib(max(r['rchar'] for r in ranks))} | {max(r['rchar'] for r in ranks) / total:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", default=None, help="the safetensors benchmark Llama (written if missing)")
    parser.add_argument("--quick", action="store_true", help="~200 MB checkpoint, for smoke tests")
    parser.add_argument("--worlds", default="1,4")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--loader", "--out", "--dcp-dir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.ckpt_dir = args.ckpt_dir or common.default_ckpt_dir(quick=args.quick)
    common.write_llama_checkpoint(args.ckpt_dir, quick=args.quick)
    args.dcp_dir = args.ckpt_dir.rstrip("/") + "_dcp"
    write_dcp(args.ckpt_dir, args.dcp_dir)
    total = sum(os.path.getsize(os.path.join(args.dcp_dir, n)) for n in os.listdir(args.dcp_dir))
    print(f"DCP checkpoint: {args.dcp_dir}, {common.mib(total)} in {len(os.listdir(args.dcp_dir)) - 1} file(s)\n")
    print("| loader | world | seconds | peak anon | lazyload's count / rank | rchar / rank | rchar / checkpoint |")
    print("|---|---|---|---|---|---|---|")
    for world in map(int, args.worlds.split(",")):
        for loader in args.loaders.split(","):
            print(row(loader, world, launch(loader, world, args), total), flush=True)


if __name__ == "__main__":
    main()
