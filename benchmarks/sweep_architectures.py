"""Every model class transformers ships, loaded by lazyload and by `from_pretrained`.

For each class in transformers' auto mappings (`MODEL_*_MAPPING_NAMES`): build a small
config (the shrinking rules below), make the model with random weights, write it with
`save_pretrained` in several shards, then compare lazyload's load into a model built on the
meta device with `from_pretrained`, tensor by tensor (parameters and every buffer) and by
the outputs of the model's own `dummy_inputs`. Prints a table by outcome; classes that no
small config could be made for, or that `from_pretrained` itself cannot load, are counted
apart.

    python benchmarks/sweep_architectures.py                      # every class (~1,570; 15-35 min on 2 cores)
    python benchmarks/sweep_architectures.py --match llama,clip   # classes whose model type contains a word
    python benchmarks/sweep_architectures.py --tp                 # causal LMs at world 2 (gloo) vs world 1

Each chunk of classes runs in a fresh process with a time limit per class, so that one
class that crashes or hangs costs only itself. `--json FILE` keeps every row.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict

SMALL = {  # field -> value, wherever a config (or a sub-config) has the field as an int
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_encoder_layers", "num_decoder_layers", "num_text_layers", "num_vision_layers"), 2),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "d_embed", "word_embed_proj_dim",
                     "text_embed_dim", "vision_embed_dim"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                     "mlp_dim", "intermediate_size_mlp", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "expert_intermediate_size"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), 16),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk"), 2),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    "rotary_dim": 16,  # at most the head dim (64 / 4 heads)
    "projection_dim": 32,
    "image_size": 32,
    "patch_size": 8,
}
MAX_POSITIONS = 512
SMALL_VOCAB = 512


def shrink(config):
    """A small copy of `config`: every size field found in SMALL (sub-configs too), vocab
    512 with special token ids renumbered below it, positions at most 512."""
    config = copy.deepcopy(config)
    _shrink(config, set())
    return config


def _shrink(config, seen):
    if id(config) in seen:
        return
    seen.add(id(config))
    overrides = _take_per_layer_overrides(config)
    old_layers = _layer_count(config)
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _shrink(value, seen)
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    for name, small in SMALL.items():
        field = getattr(type(config), name, None)
        if isinstance(field, property) and field.fset is None:  # derived (Xcodec's hidden_size): read-only
            continue
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > small:
            _set_size(config, name, small)
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            setattr(config, name, [min(v, small) for v in value])
    if isinstance(heads, int) and heads == kv and hasattr(config, "kv_lora_rank"):  # MLA: KV heads are heads
        config.num_key_value_heads = config.num_attention_heads
    _shrink_rotary_sections(config)
    _shrink_per_layer(config, old_layers, overrides, fields)
    _shrink_state_space(config)
    _shrink_backbone_stages(config)
    _shrink_stage_heads(config)
    _shrink_channel_groups(config)
    for name, value in SMALL_BY_TYPE.get(getattr(config, "model_type", None), {}).items():
        setattr(config, name, value)
    _follow_shrunk_sizes(config, fields)
    _runnable_defaults(config)
    _model_fixups(config)
    _shrink_own_rules(config)
    layers = getattr(config, "num_hidden_layers", None)
    _attention_within_layers(config, layers)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > MAX_POSITIONS:
            setattr(config, name, MAX_POSITIONS)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > SMALL_VOCAB:
        config.vocab_size = SMALL_VOCAB
        if isinstance(getattr(config, "unpadded_vocab_size", None), int):  # Inkling2: rows kept of a padded head
            config.unpadded_vocab_size = min(config.unpadded_vocab_size, SMALL_VOCAB)
        ids = sorted({i for k, v in fields.items() if k.endswith(("_token_id", "_token_index"))
                      for i in _token_ids(v) if i >= SMALL_VOCAB - 64})
        renumber = {old: SMALL_VOCAB - 64 + i for i, old in enumerate(ids[:64])}
        for k, v in fields.items():
            if k.endswith(("_token_id", "_token_index")) and any(i in renumber for i in _token_ids(v)):
                setattr(config, k, [renumber.get(i, i) for i in v] if isinstance(v, list) else renumber[v])
    _fill_unset(config)
    _fix_model_type(config)


def _token_ids(value) -> list[int]:
    """The ids of a `*_token_id` field: one int, or a list of them (GLM's eos_token_id)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _fill_unset(config) -> None:
    """Sizes a default config leaves None where the modeling code reads them as they are
    (Ministral's and HunYuan's head_dim, Nemotron's num_key_value_heads): the values the
    other models derive (hidden / heads; GQA with the small KV head count)."""
    stored = vars(config)  # not getattr: a heterogeneous config refuses global reads of per-layer fields
    heads, hidden = stored.get("num_attention_heads"), stored.get("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0:
        return
    if "head_dim" in stored and stored["head_dim"] is None:
        config.head_dim = hidden // heads
    if "num_key_value_heads" in stored and stored["num_key_value_heads"] is None:
        kv = SMALL["num_key_value_heads"]
        config.num_key_value_heads = kv if heads % kv == 0 else heads


def _layer_pattern(*kinds):
    """A per-layer list cycling through `kinds` for the config's (shrunk) layer count."""
    return lambda c: [kinds[i % len(kinds)] for i in range(c.num_hidden_layers)]


def _rope_per_layer_type(config):
    """Cohere Compass reads rope_parameters[layer_type] (3-D sections of the small head dim's
    half), which its default config leaves empty."""
    half = (config.head_dim or config.hidden_size // config.num_attention_heads) // 2
    sections = [half - 2 * (half // 4), half // 4, half // 4]
    return {t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
            for t in dict.fromkeys(config.layer_types)}


PP_OCR_DET_NECK = {  # PP-OCR's text detection neck (its published layout, [kernel, stride, padding]): no defaults
    "intraclass_block_config": {
        "reduce_channel": [1, 1, 0],
        "return_channel": [1, 1, 0],
        "vertical_long_to_small_conv_longratio": [[7, 1], [1, 1], [3, 0]],
        "vertical_long_to_small_conv_midratio": [[5, 1], [1, 1], [2, 0]],
        "vertical_long_to_small_conv_shortratio": [[3, 1], [1, 1], [1, 0]],
        "horizontal_small_to_long_conv_longratio": [[1, 7], [1, 1], [0, 3]],
        "horizontal_small_to_long_conv_midratio": [[1, 5], [1, 1], [0, 2]],
        "horizontal_small_to_long_conv_shortratio": [[1, 3], [1, 1], [0, 1]],
        "symmetric_conv_long_longratio": [[7, 7], [1, 1], [3, 3]],
        "symmetric_conv_long_midratio": [[5, 5], [1, 1], [2, 2]],
        "symmetric_conv_long_shortratio": [[3, 3], [1, 1], [1, 1]],
    },
    "scale_factor_list": [1, 2, 4, 8],
    "kernel_list": [3, 2, 2],
}

# Config class -> field -> value (or a function of the shrunk config): what a model type's
# modeling code needs but its default config leaves unset or lacks, in the small sizes.
FIXUPS = {
    "DbrxAttentionConfig": {"rope_theta": 10000.0,  # read by DbrxAttention, not a declared field
                            "clip_qkv": 8.0},  # its forward clamps with it unconditionally (DBRX-132B's value)
    "Qwen3OmniMoeTalkerTextConfig": {"shared_expert_intermediate_size": 64},  # read by its MoE block, not declared
    "Qwen3OmniMoeTalkerConfig": {"spatial_merge_size": 2},  # read by the talker, not declared (the vision's is 2)
    "Lfm2MoeConfig": {"layer_types": _layer_pattern("conv", "full_attention"),  # no default
                      "num_dense_layers": 1},  # layer 0 dense, layer 1 MoE (the default 2 leaves no expert)
    "DeepseekOcr2TextConfig": {"mlp_layer_types": _layer_pattern("dense", "sparse")},  # no default
    # all-Mamba by default; its published hybrids (Granite 4.0-H) interleave attention layers
    "GraniteMoeHybridConfig": {"layer_types": _layer_pattern("linear_attention", "full_attention")},
    "Dots1Config": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},  # no defaults
    "CohereCompassTextConfig": {"rope_parameters": _rope_per_layer_type},
    "EsmConfig": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},  # ESM-2's alphabet; no default
    "PPOCRV5ServerDetConfig": PP_OCR_DET_NECK,
    "PPOCRV6MediumDetConfig": PP_OCR_DET_NECK,
    "MoonshineStreamingConfig": {"num_key_value_heads": lambda c: c.num_attention_heads},  # read, not declared
    "T5Gemma2TextConfig": {"dropout_rate": 0.0},  # read by the encoder; only T5Gemma2Config sets it
    "HieraConfig": {"decoder_hidden_size": 32, "decoder_depth": 1, "decoder_num_heads": 2},  # the MAE decoder: no defaults
    "MobileBertConfig": {"embedding_size": 32, "intra_bottleneck_size": 32},  # below the small hidden size
    "Granite4VisionConfig": {"downsample_rate": "1/2", "deepstack_layer_map": [[-2, 0], [-1, 1]],  # no defaults;
                             "spatial_target_layers": [0, 1, 0, 1]},  # default targets layers 12-21
}


def _fix_model_type(config) -> None:
    """The FIXUPS of the config's class; an image-token vocabulary map where one is unset."""
    for name, value in FIXUPS.get(type(config).__name__, {}).items():
        setattr(config, name, value(config) if callable(value) else value)
    if "vocabulary_map" in vars(config) and config.vocabulary_map is None:  # Chameleon, Emu3: image token ids
        config.vocabulary_map = {"<image>": SMALL_VOCAB - 1}


def _every_kind_first(values: list, n: int) -> list:
    """n entries of a repeating block pattern where each kind comes once before any repeats
    (RecurrentGemma's [recurrent, recurrent, attention] in two layers keeps its attention).
    Per-layer lists are cut by `_kept_layers`, which keeps one layer of each kind."""
    kinds = list(dict.fromkeys(values))
    return (kinds + values)[:n] if len(kinds) < n else kinds[:n]


def _attention_within_layers(config, layers) -> None:
    """Layer kinds given as a period and an offset (Jamba: attention every 8th layer from
    the 4th, experts every 2nd from the 1st) or as a repeating block pattern
    (RecurrentGemma): every kind still occurs within the shrunk layer count."""
    if not isinstance(layers, int):
        return
    for name in [n for n in vars(config) if n.endswith("_layer_period")]:
        offset = name.removesuffix("period") + "offset"
        period, start = getattr(config, name), getattr(config, offset, None)
        if isinstance(period, int) and isinstance(start, int) and (period > layers or start >= layers):
            setattr(config, name, layers)
            setattr(config, offset, layers - 1)
    if "attn_layer_indices" in vars(config):  # Bamba: attention at listed layers (none by default)
        indices = config.attn_layer_indices
        if not indices or min(indices) >= layers:
            config.attn_layer_indices = [layers - 1]
    blocks = getattr(config, "block_types", None)
    if isinstance(blocks, list) and len(blocks) > layers:
        config.block_types = _every_kind_first(blocks, layers)


def _follow_shrunk_sizes(config, before: dict) -> None:
    """Sizes a config derives in its init from a size SMALL shrinks (a field left None there:
    RWKV's attention_hidden_size from hidden_size, xLSTM's embedding_dim and num_blocks) take
    the shrunk value too; an MLA query head stays the sum of its parts (Longcat's qk_head_dim
    192 = 128 + 64 is derived only when not given)."""
    import dataclasses

    if dataclasses.is_dataclass(config):
        was = {n: before[n] for n in SMALL if isinstance(before.get(n), int) and not isinstance(before[n], bool)}
        now = {n: vars(config).get(n) for n in was}  # stored values: per-layer fields are not read globally
        shrunk = {v: now[n] for n, v in was.items() if now[n] != v}
        ambiguous = {v for n, v in was.items() if v in shrunk and now[n] != shrunk[v]}
        for field in dataclasses.fields(config):
            value = vars(config).get(field.name)  # per-layer fields of a heterogeneous config are not read globally
            if (field.default is None and field.name not in SMALL and not field.name.endswith(("_token_id", "_token_index"))
                    and isinstance(value, int) and not isinstance(value, bool)
                    and value in shrunk and value not in ambiguous):
                setattr(config, field.name, shrunk[value])
    stored = vars(config)
    parts = stored.get("qk_nope_head_dim"), stored.get("qk_rope_head_dim")
    if isinstance(stored.get("qk_head_dim"), int) and all(isinstance(p, int) for p in parts):
        config.qk_head_dim = sum(parts)


def _runnable_defaults(config) -> None:
    """Defaults a model cannot run with: DeepSeek-V2's experts with no top-k (None until a
    checkpoint sets it), X-MOD's adapters with no default language (its forward needs one
    without lang_ids)."""
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
    if "num_experts_per_tok" in vars(config) and config.num_experts_per_tok is None and isinstance(experts, int):
        config.num_experts_per_tok = min(SMALL["num_experts_per_tok"], experts)
    languages = getattr(config, "languages", None)
    if getattr(config, "default_language", False) is None and languages:
        config.default_language = list(languages)[0]


def _model_fixups(config) -> None:
    """Rules a model type has of its own (by the config's model_type):
    - hrm_text: num_hidden_layers is derived, num_layers_per_stack * H_cycles * (L_cycles + 1)
      (one cache slot per layer and cycle); the layer count shrinks the stacks.
    - blt: its forward with a cache builds DynamicCache(config=BltConfig), which has no
      num_hidden_layers (fails at any size in transformers 5.24): run without a cache. Its
      local encoder/decoder project from the global transformer's width (hidden_size_global,
      not shrunk by name), and its hash embeddings have 500,002 rows per hash function.
    - xlstm: its cache rounds the query/key width (hidden_size * qk_dim_factor) up to a
      multiple of 64, its layers do not: a width of 128 keeps them equal.
    - qwen4_exp_text: its indexed-attention layers need the QSA indexer sizes, all None by
      default (one key head, budget a multiple of the compress ratio, index head >= rotary dim)."""
    kind = getattr(config, "model_type", None)
    if kind == "hrm_text" and isinstance(getattr(config, "num_layers_per_stack", None), int):
        config.num_layers_per_stack = min(config.num_layers_per_stack, SMALL["num_hidden_layers"])
        config.num_hidden_layers = config.num_layers_per_stack * config.H_cycles * (config.L_cycles + 1)
    elif kind == "xlstm" and config.hidden_size * config.qk_dim_factor % 64:
        config.hidden_size = config.embedding_dim = 128
    elif kind == "blt":
        config.use_cache = False
        for local in (config.encoder_config, config.decoder_config):
            local.hidden_size_global = config.global_config.hidden_size
        config.encoder_hash_byte_group_vocab = min(config.encoder_hash_byte_group_vocab, SMALL_VOCAB)
    elif kind == "qwen4_exp_text" and getattr(config, "indexer_n_heads", 0) is None:
        config.indexer_n_heads, config.indexer_kv_heads, config.indexer_head_dim = 2, 1, config.head_dim
        config.indexer_budget, config.indexer_compress_ratio = 8, 4


LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
LAYER_PATTERNS = ("layer_types", "layers_block_type", "attention_layers")  # one kind per layer
KEEP_EACH_KIND = {"olmo_hybrid", "zamba", "zamba2", "granitemoehybrid", "neomme"}  # hybrids: test every layer kind (OLMo-Hybrid requires both)
SMALL_LAYERS = {"zamba": 3,  # Zamba ties its shared transformer across hybrid layers: one mamba and two hybrids
                "dory": 3}  # Dory: an input, a recurrent and an output layer
LAYER_INDEX_LISTS = ("kv_source_layers",)  # per-layer lists whose values are layer indices


def _own_layer_count(config) -> int | None:
    counts = [vars(config)[n] for n in LAYER_COUNTS if isinstance(vars(config).get(n), int)]
    return counts[0] if counts else None


def _layer_count(config) -> int | None:
    """The config's own layer count, None for stage-wise configs (Swin-like `depths`,
    backbones' `stage_names`), whose lists are per stage, not per layer."""
    if "depths" in vars(config) or "stage_names" in vars(config):
        return None
    return _own_layer_count(config)


def _take_per_layer_overrides(config) -> dict | None:
    """A heterogeneous config's per-layer overrides (Gemma 4's full-attention head_dim,
    Dots3's head counts), taken off so the global fields can be read and shrunk; given
    back, for the kept layers, by `_shrink_per_layer`."""
    spec = vars(config).pop("_heterogeneity_spec", None)
    return copy.deepcopy(spec.per_layer_overrides) if spec is not None else None


def _kept_layers(config, old: int, new: int, overrides: dict | None) -> list[int]:
    """Which of the old layers the small config keeps: the first ones; where layers are of
    several kinds the first layer of each kind (then the first others) so every kind is
    loaded (a 2-layer Qwen3-Next keeps its full-attention layer: a cache of linear layers
    only cannot run); for a
    heterogeneous config the first layer and the first one with overrides, so the small
    config is heterogeneous too."""
    pattern = next((vars(config)[n] for n in LAYER_PATTERNS if isinstance(vars(config).get(n), list)), [])
    # (not where the last layers reuse earlier layers' KV, Gemma 3n: those must be of kinds the kept ones produce)
    one_kind = len(set(map(str, pattern))) < 2 or vars(config).get("num_kv_shared_layers")
    if getattr(config, "model_type", None) not in KEEP_EACH_KIND and one_kind:
        if overrides and new >= 2:
            varied = min(overrides)
            return sorted({0 if varied else 1, varied} | set(range(new - 2)))
        return list(range(new))
    firsts = sorted({kind: pattern.index(kind) for kind in reversed(pattern)}.values())[:new]
    rarest_first = sorted((i for i in range(old) if i not in firsts), key=lambda i: (pattern.count(pattern[i]), i))
    return sorted(firsts + rarest_first[:new - len(firsts)])


def _shrink_override(name: str, value, config, fields: dict):
    """A per-layer override shrunk by the ratio of the global field's small value to its
    published one (Gemma 4's full-attention head_dim 512 over 256 stays twice the small one)."""
    small, published = getattr(config, name, None), fields.get(name)
    if not (isinstance(value, int) and isinstance(small, int) and isinstance(published, int) and published > 0):
        return value
    return max(1, round(value * small / published))


def _shrink_per_layer(config, old: int | None, overrides: dict | None, fields: dict) -> None:
    """Every list with one entry per layer (layer_types, Gemma 3n's intermediate sizes,
    Laguna's head counts, Mistral Large 4's KV sources, ...) cut to the kept layers; sizes
    in them shrunk like the global field they vary (`<field>` or `<field>_per_layer`);
    per-layer overrides kept for the kept layers, shrunk the same way."""
    if getattr(config, "model_type", None) in SMALL_LAYERS and old is not None:
        setattr(config, next(n for n in LAYER_COUNTS if n in vars(config)), SMALL_LAYERS[config.model_type])
    new = _layer_count(config)
    if old is None or new is None:
        return
    shared = vars(config).get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared and new < old:  # the last layers reuse earlier layers' KV
        config.num_kv_shared_layers = new if shared >= old else max(1, min(new - 1, round(shared * new / old)))
    kept = _kept_layers(config, old, new, overrides) if new < old else list(range(old))
    renumber = {layer: i for i, layer in enumerate(kept)}
    for name, value in list(vars(config).items()):
        if not isinstance(value, list) or len(value) != old or new >= old:
            continue
        value = [value[i] for i in kept]
        if name in LAYER_INDEX_LISTS:
            value = [renumber.get(v, i) for i, v in enumerate(value)]
        small = SMALL.get(name.removesuffix("_per_layer"))
        if small is not None:
            value = [min(v, small) if isinstance(v, int) else v for v in value]
        setattr(config, name, value)
    if overrides:
        config.per_layer_config = {renumber[layer]: {k: _shrink_override(k, v, config, fields)
                                                     for k, v in layer_overrides.items()}
                                   for layer, layer_overrides in overrides.items() if layer in renumber}


STATE_SPACE_HEADS = (("expand", "num_heads", "head_dim", "n_groups", "d_ssm"),  # Mamba-2
                     ("mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_ssm"))  # Bamba, ...


def _shrink_state_space(config) -> None:
    """Mamba-2 heads split the inner width (expand * hidden, or an explicit d_ssm): where
    the small widths no longer add up, the head count is derived again from them, and the
    groups must divide it."""
    hidden = getattr(config, "hidden_size", None)
    for expand, heads, head_dim, groups, inner in STATE_SPACE_HEADS:
        values = [vars(config).get(n) for n in (expand, heads, head_dim)]
        if isinstance(hidden, int) and all(isinstance(v, int) for v in values):
            width = vars(config).get(inner) if isinstance(vars(config).get(inner), int) else values[0] * hidden
            if values[1] * values[2] == width:
                continue
            dim = min(values[2], 16, width)
            setattr(config, head_dim, dim)
            setattr(config, heads, width // dim)
            if isinstance(vars(config).get(groups), int):
                setattr(config, groups, math.gcd(getattr(config, groups), width // dim))


DEFAULT_FIELDS = {  # model types whose default config fails its own validation: the fields that make it valid
    "gemma4_assistant": {"text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0,
                                         "vocab_size_per_layer_input": 0}},  # an assistant has no per-layer inputs
}


UNSET_FIELDS = {  # model types whose defaults leave sizes the model always uses unset (None)
    "diffusion_gemma_text": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64},  # every layer has MoE
}


WIDTH_LINKS = (  # (sub-config, field, source sub-config or "" for the config itself, field): widths validated equal
    ("vision_config", "text_hidden_size", "text_config", "hidden_size"),  # Inkling2(-Loop): vision output is text input
    ("vision_config", "out_hidden_size", "text_config", "hidden_size"),  # GraniteDocling
    ("audio_config", "out_hidden_size", "text_config", "hidden_size"),  # MuseSpark
    ("flow_head_config", "condition_dim", "", "hidden_size"),  # PocketTTS, GradiumPhononTTS
    ("head_config", "audio_hidden_size", "audio_config", "hidden_size"),  # Nemotron 3 diarization / transcribe
    ("adaptor_config", "hidden_size", "text_config", "hidden_size"),  # FunASR-Nano
)
WIDTH_LINKED_TYPES = {"inkling2", "inkling2_loop", "granite_docling", "muse_spark", "pocket_tts", "gradium_phonon_tts",
                      "nemotron3_diarization", "nemotron3_5_transcribe", "nemo_speechlm", "fun_asr_nano"}


MULTI_HEAD_ONLY = {  # as many KV heads as heads: ESMC validates it; the others' checkpoints fuse q|k|v and
    "esmc", "gradium_phonon_tts", "nemotron3_5_transcribe_asr_audio",  # transformers' conversion splits the
    "nemotron3_diarization_audio", "nemotron3_5_transcribe_word_timestamp",  # fused rows in three equal parts
}


def _link_widths(config) -> None:
    """Fields that carry another (sub-)config's width, validated equal to it: set to the small width."""
    if getattr(config, "model_type", None) not in WIDTH_LINKED_TYPES:
        return
    for sub, field, source, source_field in WIDTH_LINKS:
        target, origin = getattr(config, sub, None), getattr(config, source, None) if source else config
        if isinstance(getattr(target, field, None), int) and isinstance(getattr(origin, source_field, None), int):
            setattr(target, field, getattr(origin, source_field))
    if getattr(config, "model_type", None) == "fun_asr_nano":  # its adaptor's MLP is a quarter of the text width
        config.adaptor_config.intermediate_size = config.text_config.hidden_size // 4


def _default_config(model_type: str, config_class):
    return config_class(**copy.deepcopy(DEFAULT_FIELDS.get(model_type, {})))


def _shrink_own_rules(config) -> None:
    """Fixups where a model's rule is its own."""
    model_type = getattr(config, "model_type", None)
    _link_widths(config)
    if model_type in MULTI_HEAD_ONLY:
        config.num_key_value_heads = config.num_attention_heads
    if model_type in ("wavtokenizer", "wavtokenizer_encoder"):  # no projections around the quantizer
        config.codebook_dim = config.hidden_size
    if model_type == "efficientloftr":  # stage widths; the last is the hidden size
        config.out_features = [min(v, config.hidden_size) for v in config.out_features[:-1]] + [config.hidden_size]
    if model_type == "depth_pro":  # every sub-encoder sees patches of patch_size pixels
        config.patch_size = config.image_model_config.image_size
    if model_type == "dory":  # input, recurrent and output layers add up to the layer count
        config.n_input_layers, config.n_recurrent_layers, config.n_output_layers = 1, config.num_hidden_layers - 2, 1
    if model_type == "muse_spark_audio":  # one layer per pyramid stage: keep the stages, narrow them
        config.num_hidden_layers = len(config.hidden_sizes)
        config.hidden_sizes = [min(v, SMALL["hidden_size"]) for v in config.hidden_sizes]
    adapter = getattr(config, "adapter_config", None)
    if model_type == "molmo2" and adapter is not None:  # feature layers counted from the small ViT's end
        adapter.vision_feature_layer = [-1 - i for i in range(len(adapter.vision_feature_layer))]
    if model_type == "apertus1p5":  # image then audio codebooks at the top of the small vocab
        config.vision_config.codebook_size = config.audio_config.codebook_size = 32
        config.image_token_offset = config.text_config.vocab_size - 128
        config.audio_token_offset = config.image_token_offset + 32
    for name, value in UNSET_FIELDS.get(model_type, {}).items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    for name in ("adapter_in_dim", "adapter_input_size"):  # Dots3's vision / audio adapters read their own width
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, config.hidden_size)
    text = getattr(config, "text_config", None)
    for sub in vars(config).values():  # Dots3: vision and audio adapters project into the text width
        if isinstance(getattr(sub, "adapter_out_dim", None), int) and text is not None:
            sub.adapter_out_dim = text.hidden_size
    if isinstance(getattr(config, "backbone_hidden_size", None), int):  # Gemma 4 assistants: the backbone's width
        config.backbone_hidden_size = min(config.backbone_hidden_size, SMALL["hidden_size"])
    if isinstance(getattr(config, "num_centroids", None), int):  # the vocab is split into centroids' clusters
        config.num_centroids = min(config.num_centroids, 32)
        config.centroid_intermediate_top_k = min(config.centroid_intermediate_top_k, 4)
    if model_type == "dots3_note_text" and "sliding_attention" in config.layer_types:  # SWA head = nope + rope parts
        sliding = config.per_layer_config["sliding_attention"]
        config.head_dim = sliding.qk_nope_head_dim + sliding.qk_rope_head_dim
    if model_type == "xlnet":  # d_head must be d_model // n_head
        config.d_head = config.d_model // config.n_head
    if model_type == "gpt_neo":  # attention_layers is derived from [[pattern, repeats]] again on reading
        pattern = config.attention_types[0][0]
        config.attention_types = [[pattern, max(1, config.num_layers // len(pattern))]]
        config.attention_layers = config.expand_attention_types_params(config.attention_types)


ROTARY_SECTIONS_BY_DEFAULT = {"ernie4_5_vl_moe_text": 3}  # models that read a 3-part mrope_section's default


def _shrink_rotary_sections(config) -> None:
    """3-D rotary (mrope) sections split half the head dim: after shrinking they must add
    up to the small head dim's half, also where the modeling code falls back to a default
    written for the published head dim (Ernie 4.5 VL: [22, 22, 20])."""
    rope = getattr(config, "rope_parameters", None)
    parts = ROTARY_SECTIONS_BY_DEFAULT.get(getattr(config, "model_type", None))
    if not isinstance(rope, dict) or not ("mrope_section" in rope or parts):
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    sections = rope.get("mrope_section") or [1] * parts
    if not head_dim or sum(sections) == head_dim // 2:
        return
    half = head_dim // 2
    scaled = [max(1, s * half // sum(sections)) for s in sections]
    scaled[0] += half - sum(scaled)  # what rounding lost or added
    rope["mrope_section"] = scaled


SMALL_BY_TYPE = {  # model type -> fields whose small value follows the model's own rule
    "lw_detr_vit": {"num_windows": 4},  # image_size / num_windows must be a multiple of sqrt(num_windows)
    # the cross-attention's queries and keys are as wide as the inputs (an image's 322 channels),
    # so one head as in the published image models; and a small latent array
    "perceiver": {"num_cross_attention_heads": 1, "d_latents": 64, "num_latents": 32, "num_self_attends_per_block": 2},
    "funnel": {"block_sizes": [1, 1, 1]},  # its layer count is the sum of block_sizes
    # time series: the default leaves the forecast length unset (required)
    **dict.fromkeys(("autoformer", "informer", "time_series_transformer"), {"prediction_length": 8}),
    # axial position embeddings: their widths add up to the hidden size, their shape multiplies to the positions
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 32]},
    "squeezebert": {"embedding_size": 64},  # the embeddings feed the first layer unprojected
    **dict.fromkeys(("wav2vec2-bert", "wav2vec2-conformer"), {"vocab_size": 32}),  # CTC heads need one; no default
    # the default config has no task head (published checkpoints name theirs): a small one
    "sapiens2_head": {"upsample_out_channels": [32, 32], "conv_out_channels": [32],
                      "scale_conv_out_channels": [32], "scale_final_hidden_sizes": [32, 32]},
}
SMALL_BY_CLASS = {  # class -> config fields the class itself demands of its config
    "ReformerModelWithLMHead": {"is_decoder": True},
    "T5GemmaEncoderModel": {"is_encoder_decoder": False},
}
BACKBONE_OUTPUTS = {"beit": 4}  # outputs a head needs that the default config does not pick (BEiT's FPN: 4)


def _set_size(config, name: str, value: int) -> None:
    """Sets a size field, except one a config derives and will not take (Funnel's and
    ProphetNet's `num_hidden_layers`: SMALL / SMALL_BY_TYPE set the fields it comes from)."""
    try:
        setattr(config, name, value)
    except NotImplementedError:
        pass


def _shrink_stage_heads(config) -> None:
    """Swin-like configs give each stage its depth and head count (`depths`, `num_heads`),
    the stage widths being `embed_dim` times a power of two: at most 2 blocks a stage, and
    head counts that divide the small `embed_dim` (so every stage's width too)."""
    depths, heads, width = (getattr(config, n, None) for n in ("depths", "num_heads", "embed_dim"))
    if not (isinstance(depths, (list, tuple)) and isinstance(heads, (list, tuple)) and isinstance(width, int)):
        return
    config.depths = [min(d, 2) for d in depths]
    config.num_heads = [math.gcd(h, width) for h in heads]


def _shrink_channel_groups(config) -> None:
    """Grouped convolutions over the hidden channels (Mimi's depthwise upsampling:
    `upsample_groups` = hidden size) need a group count dividing the shrunk hidden size."""
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int):
        return
    for name in [n for n in vars(config) if n.endswith("groups")]:
        value = getattr(config, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1 and hidden % value:
            setattr(config, name, math.gcd(value, hidden))


def _shrink_backbone_stages(config) -> None:
    """A backbone config names one stage per layer ("stem", "stage1".."stageN") and picks
    its outputs among them (`out_features` / `out_indices`), checked when it is read back:
    after the layer count shrinks, the stages are named again and each picked stage moves
    to the end (the stem stays the stem). A model that needs k outputs (a DPT neck's four)
    keeps k layers."""
    stages, picked = getattr(config, "stage_names", None), getattr(config, "_out_indices", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not (isinstance(stages, list) and isinstance(picked, list) and isinstance(layers, int)):
        return
    if stages != ["stem"] + [f"stage{i}" for i in range(1, len(stages))] or len(stages) - 1 <= layers:
        return
    if hasattr(config, "depths"):  # stages of several layers each (ConvNeXt, Swin): named after `depths`
        return
    picked = [i % len(stages) for i in picked]
    stem, rest = [i for i in picked if i == 0], [i for i in picked if i > 0]
    wanted = BACKBONE_OUTPUTS.get(getattr(config, "model_type", None), len(rest))
    rest = rest if len(rest) >= wanted else list(range(1, wanted + 1))
    layers = config.num_hidden_layers = max(layers, len(rest))
    config.stage_names = ["stem"] + [f"stage{i}" for i in range(1, layers + 1)]
    indices = stem + list(range(layers - len(rest) + 1, layers + 1))
    config._out_indices, config._out_features = indices, [config.stage_names[i] for i in indices]


def model_classes(match: list[str] | None = None, causal_lm: bool = False) -> list[tuple[str, str]]:
    """(model type, class name) for every class in transformers' auto mappings (only the
    causal LM mapping with `causal_lm`)."""
    import transformers
    from transformers.models.auto import modeling_auto

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    exported = set(dir(transformers))  # names only: importing each class would load every model
    types: dict[str, list[str]] = defaultdict(list)
    for name in sorted(dir(modeling_auto)):
        if causal_lm and name != "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES":
            continue
        if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES"):
            for model_type, classes in getattr(modeling_auto, name).items():
                for cls in classes if isinstance(classes, (list, tuple)) else [classes]:
                    types[cls].append(model_type)
    rows = []
    for cls, candidates in types.items():  # a class listed under several types (aliases): its own type
        if cls not in exported:  # a mapping may name a class transformers does not export
            continue
        own = [t for t in candidates if CONFIG_MAPPING_NAMES.get(t) and cls.startswith(
            CONFIG_MAPPING_NAMES[t].removesuffix("Config"))]
        rows.append((sorted(own or candidates, key=len)[0], cls))
    rows.sort()
    if match:
        rows = [(t, c) for t, c in rows if any(m in t for m in match)]
    return rows


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def _tensors(model):
    import torch

    out = dict(model.state_dict())
    out.update({f"(buffer) {n}": b for n, b in model.named_buffers()})
    return {n: t for n, t in out.items() if isinstance(t, torch.Tensor)}


def _differences(got, want) -> list[str]:
    import torch

    diffs = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.is_meta:
            diffs.append(f"{name} (left on meta)")
        elif a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"{name} ({a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)})")
        elif not torch.equal(a, b):
            diffs.append(f"{name} (values)")
    return diffs


def _outputs(model):
    import torch

    inputs = getattr(model, "dummy_inputs", None)
    if not isinstance(inputs, dict) or not inputs:
        return None
    torch.manual_seed(0)  # forwards that draw noise (DiffusionGemma's canvas) draw the same both ways
    try:
        with torch.no_grad():
            out = model(**inputs)
    except Exception:
        return None
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor)]


def _as_read_back(config_class, config, workdir: str):
    """The config as `from_pretrained` will read it back from config.json: fields a
    config derives in its init (Step3p7's vision `intermediate_size` from `mlp_ratio`, BLT's
    sub-configs) are derived again there, so the model is built with the structure that
    the saved checkpoint will be loaded into."""
    with tempfile.TemporaryDirectory(dir=workdir) as directory:
        config.save_pretrained(directory)
        return config_class.from_pretrained(directory)


def _for_class(config, class_name: str):
    """The shrunk config with the fields its class demands (SMALL_BY_CLASS)."""
    for name, value in SMALL_BY_CLASS.get(class_name, {}).items():
        setattr(config, name, value)
    return config


_SAVED: dict[str, dict] = {}  # directory -> the tensors write_small saved there (sweep_one's second witness)


def write_small(model_type: str, class_name: str, workdir: str) -> str:
    """A small model of the class (shrunk default config, random weights), saved with
    `save_pretrained` in about four shards under workdir/class_name; returns that directory."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    cls = getattr(transformers, class_name)
    config_class = CONFIG_MAPPING[model_type]
    if cls.config_class is not None and cls.config_class is not config_class:
        config_class = cls.config_class  # e.g. Llama4ForCausalLM takes the text config
    config = _as_read_back(config_class, _for_class(shrink(_default_config(model_type, config_class)), class_name),
                           workdir)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.02)
    directory = os.path.join(workdir, class_name)
    _SAVED[directory] = _tensors(model)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(directory, max_shard_size=max(total // 4, 1))
    return directory


def sweep_one(model_type: str, class_name: str, workdir: str) -> dict:
    """Build, save, load both ways and compare one class. Returns a row:
    outcome in exact | differs | outputs differ | lazyload error | no small config |
    from_pretrained fails (also where its load differs from the model saved while lazyload's
    equals it); detail says what."""
    import torch
    import transformers

    from lazyload import LazyCheckpoint

    row = {"model_type": model_type, "class": class_name}
    try:
        directory = write_small(model_type, class_name, workdir)
    except Exception as exc:
        return row | {"outcome": "no small config", "detail": _short(exc)}
    written = _SAVED.pop(directory, None)
    cls = getattr(transformers, class_name)
    try:
        reference = cls.from_pretrained(directory, attn_implementation="eager").eval()
    except Exception as exc:
        return row | {"outcome": "from_pretrained fails", "detail": _short(exc)}
    try:
        saved = cls.config_class.from_pretrained(directory)
        saved._attn_implementation = "eager"
        with torch.device("meta"):
            model = cls._from_config(saved, attn_implementation="eager", dtype=reference.dtype)
        model.eval()
        report = LazyCheckpoint(directory).load_into(model, progress=False)
    except Exception as exc:
        return row | {"outcome": "lazyload error", "detail": _short(exc)}
    diffs = _differences(_tensors(model), _tensors(reference))
    if diffs and written is not None and not _differences(_tensors(model), written):
        return row | {"outcome": "from_pretrained fails", "detail": f"its round trip changes {len(diffs)}: "
                      + ", ".join(diffs[:4]) + "; lazyload's load equals the model saved"}
    if diffs:
        return row | {"outcome": "differs", "detail": f"{len(diffs)}: " + ", ".join(diffs[:4])}
    got, want = _outputs(model), _outputs(reference)
    if want is not None and (got is None or len(got) != len(want)
                             or not all(torch.equal(a, b) for a, b in zip(got, want))):
        return row | {"outcome": "outputs differ", "detail": ""}
    return row | {"outcome": "exact", "detail": f"{len(report.loaded)} tensors"
                  + ("" if want is not None else ", no dummy forward")}


TP_WORLD = 2
TP_TOLERANCE = 1e-4  # a row-parallel all-reduce sums in another order than one matmul


def _tp_rank(rank: int, world: int, init_file: str, directory: str, class_name: str, out_dir: str) -> None:
    """One rank of the world-2 job: meta model, lazyload TP load (made runnable under the
    process group), logits of a fixed prompt saved for rank 0 of the parent to compare."""
    import torch
    import torch.distributed as dist
    import transformers

    from lazyload import LazyCheckpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = {}
    try:
        cls = getattr(transformers, class_name)
        config = cls.config_class.from_pretrained(directory)
        config._attn_implementation = "eager"
        with torch.device("meta"):
            model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
        checkpoint = LazyCheckpoint(directory)
        checkpoint.load_into(model.eval(), rank, world, progress=False)
        with torch.no_grad():
            logits = model(input_ids=_prompt(config)).logits
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        result["dtensors"] = sum(isinstance(p, DTensor) for p in model.parameters())
        # tensors held as plain local shards (not DTensors): full shape differs from the model's
        full, names = checkpoint.index, set(checkpoint.index.names())
        result["local_plain"] = sum(1 for n, p in model.named_parameters() if not isinstance(p, DTensor)
                                    and n in names and tuple(p.shape) != tuple(full.shape(n)))
        torch.save(logits, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception as exc:
        result["error"] = _short(exc)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


ROW_PER_CODEBOOK = ("musicgen_decoder", "musicgen_melody_decoder")  # input_ids: (batch * num_codebooks, seq)


def _prompt(config):
    import torch

    g = torch.Generator().manual_seed(7)
    rows = config.num_codebooks if getattr(config, "model_type", None) in ROW_PER_CODEBOOK else 1
    return torch.randint(0, min(config.get_text_config().vocab_size, SMALL_VOCAB - 64), (rows, 12), generator=g)


def sweep_tp_one(model_type: str, class_name: str, workdir: str) -> dict:
    """A causal LM at world 2 under gloo against the same load at world 1."""
    import torch
    import torch.multiprocessing as mp
    import transformers

    from lazyload import LazyCheckpoint

    row = sweep_one(model_type, class_name, workdir)
    if row["outcome"] != "exact":
        return row | {"outcome": f"world 1: {row['outcome']}"}
    directory = os.path.join(workdir, class_name)
    cls = getattr(transformers, class_name)
    config = cls.config_class.from_pretrained(directory)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    LazyCheckpoint(directory).load_into(model.eval(), progress=False)
    try:
        with torch.no_grad():
            want = model(input_ids=_prompt(config)).logits
    except Exception as exc:  # the small config makes a model that does not run (its dummy forward fails too)
        return row | {"outcome": "world 1: forward fails", "detail": _short(exc)}
    out_dir = os.path.join(workdir, f"{class_name}-tp")  # inside the chunk's temporary directory
    os.makedirs(out_dir)
    init_file = os.path.join(out_dir, "init")
    mp.start_processes(_tp_rank, args=(TP_WORLD, init_file, directory, class_name, out_dir), nprocs=TP_WORLD,
                       start_method="spawn")
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(TP_WORLD)]
    errors = [f"rank {r}: {x['error']}" for r, x in enumerate(ranks) if "error" in x]
    if errors:
        return row | {"outcome": "TP error", "detail": errors[0]}
    if not ranks[0]["dtensors"] and not ranks[0]["local_plain"]:
        return row | {"outcome": "nothing sharded", "detail": ""}
    worst = max(float((torch.load(os.path.join(out_dir, f"rank{r}.pt")) - want).abs().max()) for r in range(TP_WORLD))
    scale = float(want.abs().max())
    if worst > TP_TOLERANCE * max(scale, 1.0):
        return row | {"outcome": "TP logits differ", "detail": f"max abs diff {worst:.3g} (logits up to {scale:.3g})"}
    return row | {"outcome": "TP matches world 1", "detail": f"max abs diff {worst:.2g}"}


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


def run_chunk(rows: list[tuple[str, str]], per_class: int, tp: bool = False) -> list[dict]:
    """In this process, one class after another, each under a time limit."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    signal.signal(signal.SIGALRM, _alarm)
    out = []
    with tempfile.TemporaryDirectory(prefix="lazyload-sweep-") as workdir:
        for model_type, class_name in rows:
            signal.alarm(per_class)
            try:
                result = (sweep_tp_one if tp else sweep_one)(model_type, class_name, workdir)
            except Timeout:
                result = {"model_type": model_type, "class": class_name, "outcome": "timed out",
                          "detail": f"> {per_class} s"}
            except Exception:
                result = {"model_type": model_type, "class": class_name, "outcome": "lazyload error",
                          "detail": traceback.format_exc(limit=2)[-300:]}
            finally:
                signal.alarm(0)
            print("SWEEP_ROW " + json.dumps(result), flush=True)
            out.append(result)
    return out


def run_all(rows, chunk: int, per_class: int, on_row=lambda r: None, tp: bool = False) -> list[dict]:
    """Chunks of classes in fresh processes; a chunk that dies is retried class by class."""
    results = []
    pending = [rows[i:i + chunk] for i in range(0, len(rows), chunk)]
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    while pending:
        part = pending.pop(0)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--chunk", json.dumps(part),
                               "--per-class", str(per_class)] + (["--tp"] if tp else []), capture_output=True, text=True, env=env,
                              timeout=per_class * len(part) + 120)
        done = [json.loads(line[len("SWEEP_ROW "):]) for line in proc.stdout.splitlines()
                if line.startswith("SWEEP_ROW ")]
        for r in done:
            on_row(r)
        results += done
        rest = part[len(done):]
        if rest:  # the process died on rest[0]
            dead = {"model_type": rest[0][0], "class": rest[0][1], "outcome": "crashed",
                    "detail": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"exit {proc.returncode}"}
            on_row(dead)
            results.append(dead)
            if rest[1:]:
                pending.insert(0, rest[1:])
    return results


APART = ("no small config", "from_pretrained fails", "forward fails")  # counted apart (the last: --tp)


def _apart(outcome: str) -> bool:
    return outcome.removeprefix("world 1: ") in APART


def format_table(results: list[dict]) -> str:
    counts = Counter(r["outcome"] for r in results)
    tried = sum(n for o, n in counts.items() if not _apart(o))
    lines = ["| outcome | classes | share of those from_pretrained loads |", "|---|---|---|"]
    for outcome, n in counts.most_common():
        share = "-" if _apart(outcome) else f"{n / tried:.1%}"
        lines.append(f"| {outcome} | {n} | {share} |")
    lines.append(f"| total | {len(results)} | {tried} loaded by from_pretrained |")
    by_outcome = defaultdict(list)
    for r in results:
        if r["outcome"] not in ("exact", "TP matches world 1") and not _apart(r["outcome"]):
            by_outcome[r["outcome"]].append(r)
    for outcome, rows in by_outcome.items():
        lines += ["", f"{outcome}:"]
        lines += [f"- {r['class']} ({r['model_type']}): {r['detail']}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", default=None, help="comma-separated words; classes whose model type has one")
    parser.add_argument("--chunk", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--per-class", type=int, default=120, help="seconds allowed per class")
    parser.add_argument("--chunk-size", type=int, default=40)
    parser.add_argument("--json", default=None, help="write every row to this file")
    parser.add_argument("--tp", action="store_true", help=f"causal LMs at world {TP_WORLD} (gloo) vs world 1")
    args = parser.parse_args()
    if args.chunk:
        run_chunk([tuple(r) for r in json.loads(args.chunk)], args.per_class, args.tp)
        return
    rows = model_classes(args.match.split(",") if args.match else None, causal_lm=args.tp)
    print(f"{len(rows)} model classes", flush=True)
    start = time.time()
    results = run_all(rows, args.chunk_size, args.per_class,
                      on_row=lambda r: print(f"  {r['outcome']:<22} {r['class']}", flush=True), tp=args.tp)
    print(f"\n{len(results)} classes in {time.time() - start:.0f} s\n")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
