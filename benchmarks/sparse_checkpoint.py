"""Checkpoints at published shapes, written without using disk.

Each file has a real safetensors header (the published key names, dtypes, shapes, shard
count); its data region is a hole made with `truncate`, which reads as zeros. Loading one
measures the index, the plan, the schedule, memory and the I/O paths at full scale, not
numerics (the small real checkpoints of the tests cover those).

    python benchmarks/sparse_checkpoint.py llama-405b DIR [--layers N]
    python benchmarks/sparse_checkpoint.py deepseek-v3 DIR
    python benchmarks/sparse_checkpoint.py llama4-maverick DIR

- `llama-405b`: Llama-3.1-405B, dense, GQA with 8 KV heads, bf16, 191 shards.
- `deepseek-v3`: DeepSeek-V3 (671B), 61 layers (3 dense, 58 MoE with 256 routed experts and a
  shared expert), MLA, FP8 (`float8_e4m3fn`) weights with 128x128 `weight_scale_inv` block
  scales, the multi-token-prediction layer 61 as published, 163 shards.
- `llama4-maverick`: Llama-4-Maverick's text model (48 layers, MoE every other layer with
  128 fused 3-D experts, bf16), in `Llama4ForCausalLM`'s key names, 55 shards.

`--layers N` keeps the key structure with fewer decoder layers (shards scale with it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import time

BLOCK = 128  # DeepSeek-V3's FP8 block size (quantization_config.weight_block_size)
ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def llama_405b(layers=None):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                         num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    return _with_layers(config, layers), 191


def deepseek_v3(layers=None):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                              num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                              n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3,
                              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, n_group=8, topk_group=4, max_position_embeddings=163840,
                              tie_word_embeddings=False, dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"])
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    config.num_nextn_predict_layers = 1
    return _with_layers(config, layers), 163


def llama4_maverick(layers=None):
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                              num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                              num_local_experts=128, num_experts_per_tok=1, interleave_moe_layer_step=2,
                              max_position_embeddings=1048576, tie_word_embeddings=False, dtype="bfloat16",
                              architectures=["Llama4ForCausalLM"])
    return _with_layers(config, layers), 55


SHAPES = {"llama-405b": llama_405b, "deepseek-v3": deepseek_v3, "llama4-maverick": llama4_maverick}
FULL_LAYERS = {"llama-405b": 126, "deepseek-v3": 61, "llama4-maverick": 48}


def _with_layers(config, layers):
    if layers is not None:
        if hasattr(config, "layer_types") and config.layer_types:
            config.layer_types = config.layer_types[:layers]
        for name in ("no_rope_layers", "moe_layers"):
            value = getattr(config, name, None)
            if isinstance(value, list) and len(value) > layers:
                setattr(config, name, value[:layers])
        config.num_hidden_layers = layers
    return config


def model_class(config):
    import transformers

    return getattr(transformers, config.architectures[0])


def published_tensors(config) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype, shape) of every tensor as the published checkpoint stores it, in layer
    order. From the model's own state dict on the meta device; fused experts are written
    per expert where the published checkpoint does (DeepSeek-V3), FP8 weights get their
    block scales, and DeepSeek's multi-token-prediction layer is added."""
    import torch

    from lazyload.mapping import natural_key

    with torch.device("meta"):
        model = model_class(config)(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fp8 = getattr(config, "quantization_config", None)
    out = []
    for key in sorted(shapes, key=natural_key):
        shape = shapes[key]
        if fp8 and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out += _per_expert(key, shape)
        else:
            out.append((key, "BF16", shape))
    if fp8:
        out += _mtp_layer(config, shapes)
        out = [t for key, dtype, shape in out for t in _fp8(key, dtype, shape)]
    return out


def _per_expert(key, shape):
    prefix = key.rsplit(".", 1)[0]  # model.layers.N.mlp.experts
    experts, rows, cols = shape
    out = []
    for e in range(experts):
        if key.endswith("gate_up_proj"):
            out += [(f"{prefix}.{e}.gate_proj.weight", "BF16", (rows // 2, cols)),
                    (f"{prefix}.{e}.up_proj.weight", "BF16", (rows // 2, cols))]
        else:
            out.append((f"{prefix}.{e}.down_proj.weight", "BF16", (rows, cols)))
    return out


def _mtp_layer(config, shapes):
    """DeepSeek-V3's layer 61 (multi-token prediction): a full MoE layer plus its own
    embedding, norms and projection; transformers ignores it (_keys_to_ignore_on_load_unexpected)."""
    last = config.num_hidden_layers - 1
    n = config.num_hidden_layers
    layer = [(k.replace(f"layers.{last}.", f"layers.{n}."), s) for k, s in shapes.items() if f"layers.{last}." in k]
    extra = [(f"model.layers.{n}.embed_tokens.weight", shapes["model.embed_tokens.weight"]),
             (f"model.layers.{n}.enorm.weight", (config.hidden_size,)),
             (f"model.layers.{n}.hnorm.weight", (config.hidden_size,)),
             (f"model.layers.{n}.eh_proj.weight", (config.hidden_size, 2 * config.hidden_size)),
             (f"model.layers.{n}.shared_head.norm.weight", (config.hidden_size,)),
             (f"model.layers.{n}.shared_head.head.weight", shapes["lm_head.weight"])]
    out = []
    for key, shape in layer + extra:
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out += _per_expert(key, shape)
        else:
            out.append((key, "BF16", shape))
    return out


_NOT_FP8 = re.compile(r"(embed_tokens|lm_head|shared_head\.head|norm|mlp\.gate\.|e_score_correction_bias)")


def _fp8(key, dtype, shape):
    """A Linear weight as published in DeepSeek-V3: FP8 data and F32 block scales."""
    if len(shape) != 2 or not key.endswith(".weight") or _NOT_FP8.search(key):
        return [(key, dtype, shape)]
    scales = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
    return [(key, "F8_E4M3", shape), (key + "_scale_inv", "F32", scales)]


def write(name: str, directory: str, layers: int | None = None) -> dict:
    """Write the sparse checkpoint `name` into `directory`; returns a summary."""
    start = time.perf_counter()
    config, shards = SHAPES[name](layers)
    if layers is not None:
        shards = max(1, round(shards * layers / FULL_LAYERS[name]))
    tensors = published_tensors(config)
    total = sum(math.prod(s) * ITEMSIZE[d] for _, d, s in tensors)
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    target = total / shards
    weight_map, files, current, size = {}, [], [], 0
    for key, dtype, shape in tensors:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if current and size + nbytes / 2 > target * (len(files) + 1) and len(files) < shards - 1:
            files.append(current)
            current = []
        current.append((key, dtype, shape, nbytes))
        size += nbytes
    files.append(current)
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for fname, content in zip(names, files):
        _write_sparse_file(os.path.join(directory, fname), content)
        weight_map.update({key: fname for key, *_ in content})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return {"name": name, "tensors": len(tensors), "files": len(files), "bytes": total,
            "seconds": time.perf_counter() - start, "layers": config.num_hidden_layers}


def _write_sparse_file(path: str, content) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, dtype, shape, nbytes in content:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole, read as zeros, no disk used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory")
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args()
    summary = write(args.shape, args.directory, args.layers)
    print(f"{summary['name']}: {summary['tensors']:,} tensors in {summary['files']} files, "
          f"{summary['bytes'] / 1e9:,.1f} GB (sparse), {summary['layers']} layers, written in {summary['seconds']:.1f} s")


if __name__ == "__main__":
    main()
