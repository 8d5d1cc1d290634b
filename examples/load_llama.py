"""Load a sharded Llama checkpoint into a model built on the meta device.

    python examples/load_llama.py [CHECKPOINT_DIR]

Without a directory, a small real Llama checkpoint (random weights, several shards) is
written by transformers' save_pretrained into a temporary directory, removed at the end.
The loaded model is checked against transformers' from_pretrained and the report is printed.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lazyload import LazyCheckpoint


def write_example_checkpoint(directory: str) -> str:
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, max_shard_size="4MB")
    return directory


def main() -> None:
    if len(sys.argv) > 1:
        sys.exit(check(sys.argv[1]))
    with tempfile.TemporaryDirectory(prefix="lazyload-llama-") as directory:
        status = check(write_example_checkpoint(directory))
    sys.exit(status)


def check(path: str) -> int:
    """Load `path` lazily and compare with from_pretrained; 0 when the logits are identical."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)

    ckpt = LazyCheckpoint(path)
    print(f"{path}: {len(ckpt)} tensors in {len(ckpt.files)} files, {ckpt.total_bytes / 2**20:.1f} MiB")
    report = ckpt.load_into(model)
    print(report)

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokens = torch.arange(16).unsqueeze(0) % config.vocab_size
    with torch.no_grad():
        same = torch.equal(model(tokens).logits, reference(tokens).logits)
    print(f"logits identical to from_pretrained: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
