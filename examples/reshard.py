"""Write a checkpoint pre-sharded for 4 ranks, then load it at this torchrun's world and generate.

    torchrun --nproc-per-node 2 examples/reshard.py [CHECKPOINT_DIR]   # the world-4 copy, merged for 2 ranks
    torchrun --nproc-per-node 4 examples/reshard.py [CHECKPOINT_DIR]   # at world 4: each rank reads its own file

Rank 0 writes the copy with `lazyload.save_sharded(checkpoint, copy, world=4)` (the same as
`lazyload reshard CHECKPOINT COPY --world 4`): one safetensors file per rank holding exactly
the slices that rank loads, and lazyload_sharded.json. Without a directory it first writes a
small real Llama checkpoint. Every rank then builds the model on meta and calls
`LazyCheckpoint(copy).load_into(model, rank, world)`: at world 4 each rank reads its own file
front to back; at world 2 each rank reads the two files that hold its half. The ranks
greedy-generate from a fixed prompt; the script exits non-zero unless every rank produced
the tokens of transformers' from_pretrained on the original (world 1).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import lazyload
from tp_torchrun import NEW_TOKENS, PROMPT, exit_without_teardown, greedy, say, write_example_checkpoint

WRITTEN_FOR = 4
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LAZYLOAD_PROGRESS", "0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: write a small Llama)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    written = []  # temporary directories rank 0 made: removed at the end, whatever happens
    try:
        return reshard_and_load(args.checkpoint, written)
    finally:
        for directory in written:
            shutil.rmtree(directory, ignore_errors=True)
        dist.destroy_process_group()


def reshard_and_load(checkpoint: str | None, written: list[str]) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = [checkpoint, None]
    if rank == 0:
        if paths[0] is None:
            written.append(tempfile.mkdtemp(prefix="lazyload-original-"))
            paths[0] = write_example_checkpoint(written[-1])
        written.append(tempfile.mkdtemp(prefix=f"lazyload-tp{WRITTEN_FOR}-"))
        paths[1] = written[-1]
        # Inside the process group too: save_sharded writes every rank's file from this one process.
        layout = lazyload.save_sharded(paths[0], paths[1], WRITTEN_FOR)
        say(f"[rank 0] wrote {layout} and {WRITTEN_FOR} rank files")
    dist.broadcast_object_list(paths, src=0)  # also the barrier: the others wait for the write
    original, copy = paths

    config = AutoConfig.from_pretrained(copy)  # save_sharded copies config.json
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    report = lazyload.LazyCheckpoint(copy).load_into(model.eval(), rank, world, progress=False)
    say(f"[rank {rank}] read {report.bytes_read + report.bytes_mapped} bytes of the world-{WRITTEN_FOR} copy "
        f"at world {world}")
    tokens = greedy(model, PROMPT, NEW_TOKENS, torch.device("cpu"))
    say(f"[rank {rank}] world {world} tokens: {tokens}")

    reference = [None]
    if rank == 0:
        ref = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32, attn_implementation="eager")
        reference[0] = greedy(ref.eval(), PROMPT, NEW_TOKENS, torch.device("cpu"))
    dist.broadcast_object_list(reference, src=0)
    ok = tokens == reference[0]
    say(f"[rank {rank}] {'OK' if ok else 'MISMATCH'}: world 1 (from_pretrained on the original) {reference[0]}")
    dist.barrier()  # every rank is done with the files
    return 0 if ok else 1


if __name__ == "__main__":
    exit_without_teardown(main())  # as tp_torchrun.py: gloo's threads may abort a teardown after success
