"""What a cooperative load adds to planning for the replicas' agreement (issue 30): the
digest of each plan field (`lazyload.digest.field_digests`) and of the checkpoint headers
(`header_digest`), against the plan itself, in CPU seconds of one rank, on sparse
checkpoints at their published shapes and a reduced depth (benchmarks/sparse_checkpoint.py).

    python benchmarks/bench_digest.py --dir /path/with/room [--shapes llama-405b:16,deepseek-v3:8] [--world 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparse_checkpoint  # noqa: E402
from bench_scale import meta_model  # noqa: E402


def measure(directory: str, world: int) -> dict:
    from lazyload import LazyCheckpoint
    from lazyload.digest import header_digest, plan_digest
    from lazyload.planner import LoadOptions, plan_load

    checkpoint, model = LazyCheckpoint(directory), meta_model(directory)
    options = LoadOptions(strict=False, missing="keep")  # the reduced depth's extra layers (DeepSeek's MTP)
    started = time.process_time()
    plan = plan_load(checkpoint, model, 0, world, options, preview=True)
    planned = time.process_time()
    plan_digest(plan)
    digested = time.process_time()
    header_digest(plan.index)
    return {"items": len(plan.items), "targets": len(plan.targets), "plan": planned - started,
            "digest": digested - planned, "header": time.process_time() - digested}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--shapes", default="llama-405b:16,deepseek-v3:8", help="name:layers,...")
    parser.add_argument("--world", type=int, default=8)
    args = parser.parse_args()
    print("| checkpoint | layers | read items, targets (rank 0) | plan | plan digest | header digest |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        name, layers = shape.split(":")
        directory = os.path.join(args.dir, f"{name}-L{layers}")
        if not os.path.exists(directory):
            sparse_checkpoint.write(name, directory, layers=int(layers))
        r = measure(directory, args.world)
        print(f"| {name} | {layers} | {r['items']:,}, {r['targets']:,} | {r['plan']:.2f} s | {r['digest']:.2f} s "
              f"| {r['header']:.2f} s |")


if __name__ == "__main__":
    main()
