"""Megatron-Core `torch_dist` checkpoints written by Megatron's own `dist_checkpointing.save`
(megatron-core 0.16.1) on CPU, for the tests: a GPTModel (local layer spec, RMSNorm, SwiGLU,
grouped-query attention, RoPE: a Llama) at TP 2 under gloo, and Megatron's own logits on
fixed tokens to check the conversion against.

Megatron calls `torch.cuda.current_device()` and `torch.cuda.synchronize()` while saving,
and its RNG tracker's `fork()` in the forward; on a CPU-only machine the writer replaces
those three with CPU no-ops (nothing written changes)."""
from __future__ import annotations

import argparse
import contextlib
import os

import torch

from gloo import spawn_cases

HEADS, GROUPS, HIDDEN, FFN, LAYERS, VOCAB, SEQ = 4, 2, 64, 128, 2, 256, 12


def hf_config():
    """The transformers Llama config of the Megatron model."""
    import transformers as tf

    return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=GROUPS, rms_norm_eps=1e-5,
                          tie_word_embeddings=False, max_position_embeddings=128)


def tokens() -> torch.Tensor:
    return (torch.arange(SEQ)[None] * 7) % VOCAB


def _cpu_only() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _gpt_model(world: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=FFN, use_cpu_initialization=True,
                               normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                               activation_func=torch.nn.functional.silu, params_dtype=torch.float32,
                               tensor_model_parallel_size=world)
    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=128, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, parallel_output=False).eval()


def _save(directory, rank, world):
    from megatron.core import dist_checkpointing, parallel_state

    _cpu_only()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = _gpt_model(world)
    with torch.no_grad():
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
        logits = model(tokens(), torch.arange(SEQ)[None], mask)
    state = model.sharded_state_dict()
    state["args"] = argparse.Namespace(num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
                                       hidden_size=HIDDEN, kv_channels=HIDDEN // HEADS)  # as Megatron-LM saves it
    iteration = os.path.join(directory, "iter_0000100")
    os.makedirs(iteration, exist_ok=True)
    dist_checkpointing.save(state, iteration)
    if rank == 0:
        torch.save(logits, os.path.join(directory, "megatron_logits.pt"))
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("100")
    parallel_state.destroy_model_parallel()


def save_megatron(directory, tmp_path) -> None:
    """A Megatron-LM-style save directory at `directory` (tracker + iter_0000100/), and
    Megatron's logits for `tokens()` beside it."""
    spawn_cases(2, [str(directory)], tmp_path, _save)
