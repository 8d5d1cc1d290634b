"""Blocks whose forward cannot run on the split transformers' own TP plan gives them stay
whole, as the structural rule keeps such blocks whole: Doge's attention (its plan splits
`dt_proj` rowwise, but the dynamic mask it makes, one value per KV head, meets the rank's
heads inside the forward) and Gemma 4's embedding (its multimodal forward reads
`embed_tokens.weight[pad_token_id]` outside the vocab-split embedding). The placements are
checked here on meta; tests/test_tp_models.py runs both at world 2 against world 1."""
from __future__ import annotations

import re

import torch

from lazyload.tp.placements import static_placements
from lazyload.targets import TargetSpec

from test_sweep import sweep


def _placements(class_name: str) -> dict[str, str]:
    """The plan's placements at world 2 of the class's small model, by layer pattern."""
    import transformers

    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        model = cls(sweep.shrink(cls.config_class()))
    specs = {n: TargetSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    return {re.sub(r"\.\d+\.", ".*.", n): p.kind for n, p in static_placements(model, specs, "tp", 2).items()}


def test_doge_attention_stays_whole_and_its_mlp_splits():
    placed = _placements("DogeForCausalLM")
    assert not [n for n in placed if ".self_attn." in n]
    assert {n for n in placed if ".mlp." in n} >= {"model.layers.*.mlp.up_proj.weight",
                                                  "model.layers.*.mlp.down_proj.weight"}


def test_gemma4_embedding_read_outside_stays_whole():
    placed = _placements("Gemma4ForConditionalGeneration")
    assert "model.language_model.embed_tokens.weight" not in placed
    assert placed["model.language_model.layers.*.self_attn.q_proj.weight"] == "shard"


def test_a_plan_that_runs_split_keeps_every_entry():
    placed = _placements("LlamaForCausalLM")
    assert placed["model.embed_tokens.weight"] == "shard" and placed["model.layers.*.self_attn.o_proj.weight"] == "shard"
