"""Live weight sync (issue 32): `lazyload.WeightSync` against gather-then-load on the same
ranks. Half the ranks train (FSDP2 over them, bf16 Llama), the other half serve (tensor
parallel over them, built on meta); every rank runs both approaches on the same weights:

- WeightSync: each server rank receives its slices from the trainer ranks that hold them,
  point to point (the plan made once, at construction: "plan s");
- gather-then-load (what slime, verl and OpenRLHF do): the trainers all-gather each full
  tensor (`DTensor.full_tensor`), trainer rank 0 broadcasts it to the server ranks, each
  server rank copies its slices out of it.

Per rank: bytes sent and received per sync, seconds per sync (median of --repeat, after a
first sync that makes the server real), and the server's share. Both approaches are checked
to leave the server bit-equal.

With `--quantize int8|fp8|fp8-block` the server is quantized on the way (`WeightSync(quantize=)`:
int8 or fp8 with a scale per 128 input columns, or transformers' FP8Linear blocks of 128 x 128),
each trainer rank quantizing its boxes before it sends them, and the table sets its bytes and
seconds beside a bf16 sync of the same weights into a bf16 server (no gather-then-load).

    python benchmarks/bench_sync.py [--world 8] [--layers N] [--quick] [--repeat 3] [--quantize int8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def build(shape, trainer_mesh, serving):
    """The trainer's FSDP2 model (bf16; built on meta and sharded first, so that each trainer
    rank holds only its shard, filled with random values), or the server's meta model."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    with torch.device("meta"), common.default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(common.llama_config(shape))
    if serving:
        return model
    for layer in model.model.layers:
        fully_shard(layer, mesh=trainer_mesh)
    fully_shard(model, mesh=trainer_mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(trainer_mesh.get_local_rank())
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.to_local().copy_(torch.randn(tensor.to_local().shape, generator=generator))
    return model


def gather_then_load(trainer, server, names, shapes, group, targets):
    """One gather-then-load sync; returns (bytes sent, bytes received) by this rank."""
    import torch
    import torch.distributed as dist

    sent = received = 0
    state = trainer.state_dict() if trainer is not None else server.state_dict()
    for name in names:
        if trainer is not None:
            tensor = state[name]
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            received += full.nbytes - tensor.to_local().nbytes if hasattr(tensor, "to_local") else 0
            if dist.get_rank() == 0:
                dist.broadcast(full.contiguous(), group_src=0, group=group)
                sent += full.nbytes * (group.size() - 1)
            continue
        full = torch.empty(shapes[name], dtype=torch.bfloat16)
        dist.broadcast(full, group_src=0, group=group)
        received += full.nbytes
        local = state[name]
        local = local._local_tensor if hasattr(local, "_local_tensor") else local
        for region in targets[name].regions:
            at = tuple(slice(s, s + b - a) for (a, b), s in zip(region.global_box, region.local_start))
            local[at].copy_(full[tuple(slice(a, b) for a, b in region.global_box)])
    return sent, received


def server_copy(server):
    return {n: (t._local_tensor if hasattr(t, "_local_tensor") else t).clone() for n, t in server.state_dict().items()}


def timed(run, repeat):
    """Median seconds of `run()` over `repeat` calls (every rank in step: barriers around), and its last result."""
    import torch.distributed as dist

    seconds, result = [], None
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        result = run()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def quantization(name):
    import lazyload

    if name == "fp8-block":
        return lazyload.Quantization("fp8", format="transformers")
    return lazyload.Quantization(name, torchao=False)


def quantized_worker(args, rank, mesh, serving, trainer, shape):
    """The bf16 sync and the quantized one of the same weights, each into a server of its own."""
    import lazyload

    record = dict(rank=rank, role="server" if serving else "trainer")
    for kind, quantize in (("bf16", None), ("quantized", args.quantize)):
        server = build(shape, None, True) if serving else None
        sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["ranks"] if serving else None,
                                   quantize=quantize and quantization(quantize))
        sync()
        seconds, report = timed(sync, args.repeat)
        record.update({f"{kind}_sent": report.bytes_sent, f"{kind}_received": report.bytes_received,
                       f"{kind}_seconds": seconds, f"{kind}_on_wire": report.quantized_on_wire,
                       f"{kind}_steps": sync.routes.steps})
    return record


def quantized_table(ranks, quantize):
    mib = common.mib
    lines = ["| rank | role | bf16 sync: sent MiB | received MiB | s per sync | "
             f"{quantize} sync: sent MiB | received MiB | of which quantized MiB | s per sync | bytes / bf16's | "
             "quantized layers' bytes / bf16's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ranks:
        moved, bf16 = r["quantized_sent"] + r["quantized_received"], r["bf16_sent"] + r["bf16_received"]
        layers = r["quantized_on_wire"] + bf16 - moved  # those layers' bf16 bytes: the rest moved the same
        lines.append(f"| {r['rank']} | {r['role']} | {mib(r['bf16_sent'])} | {mib(r['bf16_received'])} | "
                     f"{r['bf16_seconds']:.3f} | {mib(r['quantized_sent'])} | {mib(r['quantized_received'])} | "
                     f"{mib(r['quantized_on_wire'])} | {r['quantized_seconds']:.3f} | "
                     f"{moved / bf16:.2f}x | {r['quantized_on_wire'] / layers:.2f}x |")
    lines.append(f"\n{ranks[0]['bf16_steps']} steps per bf16 sync, {ranks[0]['quantized_steps']} per {quantize} sync.")
    return "\n".join(lines)


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import lazyload

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("role", "ranks"))
    serving = mesh.get_coordinate()[0] == 1
    shape = common.checkpoint_shape(args.layers, args.quick)
    model = build(shape, mesh["ranks"], serving)
    trainer, server = (None, model) if serving else (model, None)
    if args.quantize:
        record = quantized_worker(args, rank, mesh, serving, trainer, shape)
        with open(os.path.join(args.out, f"rank{rank:03d}.json"), "w") as f:
            json.dump(record, f)
        return dist.destroy_process_group()
    dist.barrier()  # the plan's seconds, not the wait for the slowest rank's model
    start = time.perf_counter()
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["ranks"] if serving else None)
    plan_seconds = time.perf_counter() - start
    first = sync()
    sync_seconds, report = timed(sync, args.repeat)
    after_sync = server_copy(server) if serving else None
    group = dist.new_group([0] + [r for r in range(world // 2, world)])
    meta = build(shape, None, True)
    names = sorted(meta.state_dict())
    shapes = {n: tuple(t.shape) for n, t in meta.state_dict().items()}
    targets = {t.name: t for t in sync.load_plan.targets} if serving else {}
    gather_seconds, (g_sent, g_received) = timed(
        lambda: gather_then_load(trainer, server, names, shapes, group, targets), args.repeat)
    if serving:
        assert all(torch.equal(after_sync[n], t) for n, t in server_copy(server).items()), "sync != gather"
    share = sum(t.nbytes for t in after_sync.values()) if serving else 0
    record = dict(rank=rank, role="server" if serving else "trainer", plan_seconds=plan_seconds,
                  first_seconds=first.seconds, sync_seconds=sync_seconds, sync_sent=report.bytes_sent,
                  sync_received=report.bytes_received, gather_seconds=gather_seconds, gather_sent=g_sent,
                  gather_received=g_received, share=share, model_bytes=sum(t.nbytes for t in meta.state_dict().values()),
                  steps=sync.routes.steps)
    with open(os.path.join(args.out, f"rank{rank:03d}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


def table(ranks):
    mib = common.mib
    lines = ["| rank | role | share MiB | sync: sent MiB | received MiB | received / share | s per sync | "
             "gather-then-load: sent MiB | received MiB | s per sync | sync / gather time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ranks:
        share = f"{r['sync_received'] / r['share']:.2f}x" if r["share"] else "-"
        lines.append(f"| {r['rank']} | {r['role']} | {mib(r['share'])} | {mib(r['sync_sent'])} | "
                     f"{mib(r['sync_received'])} | {share} | {r['sync_seconds']:.3f} | {mib(r['gather_sent'])} | "
                     f"{mib(r['gather_received'])} | {r['gather_seconds']:.3f} | "
                     f"{common.ratio(r['sync_seconds'], r['gather_seconds'])} |")
    plan = max(r["plan_seconds"] for r in ranks)
    lines.append(f"\nplan (construction) {plan:.2f} s on the slowest rank; first sync (makes the server real) "
                 f"{max(r['first_seconds'] for r in ranks):.2f} s; {ranks[0]['steps']} steps per sync; model "
                 f"{mib(ranks[0]['model_bytes'])} MiB bf16.")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="the ~200 MB Llama instead of the 2.2 GB one")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quantize", choices=("int8", "fp8", "fp8-block"),
                        help="a quantized server, beside a bf16 sync (see the docstring)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    worker_args = [f"--repeat={args.repeat}"] + (["--quick"] if args.quick else []) + (
        [f"--layers={args.layers}"] if args.layers else []) + ([f"--quantize={args.quantize}"] if args.quantize else [])
    ranks, wall = common.torchrun_ranks(__file__, args.world, worker_args, 3600, env)
    print(quantized_table(ranks, args.quantize) if args.quantize else table(ranks))
    print(f"\n(job wall {wall:.0f} s)")


if __name__ == "__main__":
    main()
