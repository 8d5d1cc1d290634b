"""Tensor-parallel load and greedy generation under torchrun.

    torchrun --nproc-per-node 2 examples/tp_torchrun.py [CHECKPOINT_DIR] [--dtype float32|bfloat16]

Every rank builds the model on the meta device from the checkpoint's config and calls
`LazyCheckpoint(dir).load_into(model, rank, world)`: under an initialised process group
that makes the model tensor parallel (DTensor, transformers' TP plan) and fills only this
rank's shard. Each rank then greedy-generates a few tokens from a fixed prompt.

Without a directory, rank 0 first writes a small real Llama checkpoint (random weights,
bf16, several shards) with transformers' save_pretrained into a temporary directory (removed
at the end); the other ranks wait at a barrier.

Rank 0 also loads the checkpoint with transformers' from_pretrained (world 1) and generates
from the same prompt. The script exits non-zero unless every rank produced exactly the
world-1 tokens. Backend: nccl when CUDA is available (one GPU per rank), else gloo (CPU).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lazyload import LazyCheckpoint

PROMPT = [1, 306, 465, 278, 659, 310, 283, 338]  # fixed token ids, below every vocab size used here
NEW_TOKENS = 8



def say(text: str) -> None:
    """One write per message: ranks share stdout, and print() writes the text and its
    newline separately, so lines of two ranks could run together."""
    os.write(sys.stdout.fileno(), (text + "\n").encode())

def write_example_checkpoint(directory: str) -> str:
    # 8 heads, 2 KV heads: at world 4 the KV heads are replicated over pairs of ranks.
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, max_shard_size="1MB")
    return directory


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    """Greedy decoding with plain forward calls over the whole sequence (no KV cache)."""
    ids = torch.tensor([prompt], device=device)
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits
        if not isinstance(logits, torch.Tensor) or type(logits).__name__ == "DTensor":
            logits = logits.full_tensor()
        next_id = logits[:, -1].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
    return ids[0, len(prompt):].tolist()


def tagged(rank: int, text: str) -> str:
    return "\n".join(f"[rank {rank}] {line}" for line in str(text).splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: write a small Llama)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (float32 default: the TP all-reduce sums in another order than "
                             "world 1, and float32 keeps that far below the logit gaps)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # The checkpoint: given, or written by rank 0 while the others wait.
    path = [args.checkpoint]
    written = None
    if path[0] is None and rank == 0:
        written = path[0] = write_example_checkpoint(tempfile.mkdtemp(prefix="lazyload-tp-"))
    dist.broadcast_object_list(path, src=0)  # also the barrier: the others wait for the write
    path = path[0]

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    model.eval()
    report = LazyCheckpoint(path).load_into(model, rank, world, progress=False)
    say(tagged(rank, report))
    # Ranks of one node share its page cache (a strided span they all read is fetched once).
    say(f"[rank {rank}] node {os.environ.get('GROUP_RANK', '0')}, ranks on this node: "
        f"{os.environ.get('LOCAL_WORLD_SIZE', '1')}")

    if max(PROMPT) >= config.vocab_size:  # a sharded embedding maps unknown ids to zeros, silently
        raise SystemExit(f"the prompt's token ids must be < vocab_size {config.vocab_size}")
    tokens = greedy(model, PROMPT, NEW_TOKENS, device)
    say(f"[rank {rank}] world {world} tokens: {tokens}")

    reference = [None]
    if rank == 0:
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device)
        reference[0] = greedy(ref_model.eval(), PROMPT, NEW_TOKENS, device)
        say(f"[rank 0] world 1 tokens (from_pretrained): {reference[0]}")
        del ref_model
    all_tokens = [None] * world
    dist.all_gather_object(all_tokens, tokens)
    dist.broadcast_object_list(reference, src=0)
    ok = all(t == reference[0] for t in all_tokens)
    if rank == 0:
        if ok:
            say(f"[rank 0] OK: all {world} ranks generated the world-1 tokens {reference[0]}")
        else:
            for r, t in enumerate(all_tokens):
                say(f"[rank 0] MISMATCH: rank {r} {t} vs world 1 {reference[0]}")
    dist.barrier()
    dist.destroy_process_group()
    if written is not None:  # every rank is done with it (the barrier above)
        shutil.rmtree(written)
    return 0 if ok else 1


def exit_without_teardown(code: int) -> None:
    """Exit at once, without interpreter teardown: torch keeps the gloo process group and its
    threads alive past destroy_process_group (DTensor's caches hold the device mesh), and gloo
    threads alive during teardown occasionally abort a run that succeeded ("terminate called
    without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("LAZYLOAD_PROGRESS", "0")
    exit_without_teardown(main())  # the process group is destroyed; an exception exits through Python as usual
