"""Checkpoints of a transformers Llama's weights written by the training libraries' own save
code, for case_vllm.py's sources case; run by the main suite's python (megatron-core and
DeepSpeed are in its test extra, not in the vLLM venv):

    python tests/in_vllm/write_sources.py megatron WEIGHTS OUT   # Megatron-Core torch_dist (TP 1 save)
    python tests/in_vllm/write_sources.py deepspeed WEIGHTS OUT  # DeepSpeed AutoTP's save_mp_checkpoint_path (TP 2)

WEIGHTS is a save_pretrained directory (config.json, safetensors shards). Megatron: a
GPTModel of the config's shapes (local layer spec) holding those weights, under Megatron's
names and layouts, saved by `dist_checkpointing.save` as Megatron-LM saves (tracker,
iter_0000100/, `args` in the common state). DeepSpeed: the transformers model with those
weights made tensor parallel by `deepspeed.init_inference` (AutoTP, 2 gloo ranks), which
writes ds_inference_config.json, non-tp.pt and each rank's tp_RR_MM.pt.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: gloo.py, megatron_dist_checkpoints.py, deepspeed_models.py
sys.path.insert(0, HERE)  # this module, for the spawned ranks

from gloo import end_rank, spawn_cases, spawn_collecting  # noqa: E402


def hf_weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))) for k, v in load_file(path).items()}


def as_megatron(hf: dict, config) -> dict:
    """transformers' Llama names and layouts as Megatron's (the inverse of lazyload's reading):
    linear_qkv rows per query group [its q heads, its k, its v]; linear_fc1 [gate; up]."""
    groups, heads, dim = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = (hf[f"{h}self_attn.{p}_proj.weight"] for p in "qkv")
        per_group = (q.view(groups, heads // groups, dim, -1), k.view(groups, 1, dim, -1), v.view(groups, 1, dim, -1))
        out.update({m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
                    m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
                    m + "self_attention.linear_qkv.weight": torch.cat(per_group, 1).reshape(-1, q.shape[1]),
                    m + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
                    m + "mlp.linear_fc1.weight": torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]),
                    m + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"]})
    return out


def _save_megatron(case, rank, world):
    import transformers
    from megatron.core import dist_checkpointing, parallel_state

    import megatron_dist_checkpoints as writer

    weights, out = case
    config = transformers.AutoConfig.from_pretrained(weights)
    # the main suite's Megatron test model, at this config's shapes (its constants are read at call time)
    writer.HIDDEN, writer.FFN, writer.LAYERS = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    writer.HEADS, writer.GROUPS, writer.VOCAB = config.num_attention_heads, config.num_key_value_heads, config.vocab_size
    writer.HEAD_DIM = {"llama": config.head_dim}
    writer._cpu_only()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = writer._gpt_model("llama", world)
    wanted = as_megatron(hf_weights(weights), config)
    missing, unexpected = model.load_state_dict(wanted, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    state = model.sharded_state_dict()
    state["args"] = argparse.Namespace(num_attention_heads=writer.HEADS, num_query_groups=writer.GROUPS,
                                       group_query_attention=True, hidden_size=writer.HIDDEN,
                                       kv_channels=config.head_dim)  # as Megatron-LM saves it
    iteration = os.path.join(out, "iter_0000100")
    os.makedirs(iteration, exist_ok=True)
    dist_checkpointing.save(state, iteration)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("100")
    parallel_state.destroy_model_parallel()


def _save_deepspeed(rank, world, weights, out, init_file, errors):
    import traceback

    try:
        from deepspeed_models import init_deepspeed_rank

        init_deepspeed_rank(rank, world, init_file)
        import deepspeed
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
        deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                 replace_with_kernel_inject=False, save_mp_checkpoint_path=out)
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
    end_rank()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("library", choices=["megatron", "deepspeed"])
    parser.add_argument("weights")
    parser.add_argument("out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lazyload-writer-") as tmp:
        if args.library == "megatron":
            spawn_cases(1, [(args.weights, args.out)], Path(tmp), _save_megatron)
        else:
            spawn_collecting(_save_deepspeed, (2, args.weights, args.out, os.path.join(tmp, "pg")), 2)


if __name__ == "__main__":
    main()
