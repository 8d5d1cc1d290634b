"""lazyload's own conversion rules give the same expressions as transformers' published
mapping, so that a checkpoint converts the same way with or without transformers."""
from __future__ import annotations

import torch

from checkpoints import build_model
from lazyload import LazyCheckpoint
from lazyload.expr import Cat, Stack
from lazyload.hf_rules import hf_rules
from lazyload.mapping import TargetSpec, build_mapping
from lazyload.rules import BUILTIN_RULES, rules_from


def _mapping(directory, model, renames, converts):
    index = LazyCheckpoint(str(directory)).index
    specs = {n: TargetSpec(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    return build_mapping(index, specs, base_prefix=model.base_model_prefix, renames=renames, converts=converts)


def test_builtin_mixtral_rules_equal_transformers_mapping(checkpoint):
    directory, config = checkpoint("mixtral", "fp32")
    model = build_model("mixtral", config, torch.float32)
    ours = _mapping(directory, model, *rules_from(BUILTIN_RULES["mixtral"]))
    theirs = _mapping(directory, model, *hf_rules(model))
    assert ours == theirs
    assert not ours.missing and not ours.unexpected and not ours.mismatched
    fused = ours.exprs["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(fused, Cat) and fused.dim == 1
    assert all(isinstance(p, Stack) and len(p.parts) == config.num_local_experts for p in fused.parts)
    # experts stack in index order, gate (w1) before up (w3)
    assert [str(p) for p in fused.parts[0].parts] == [
        f"model.layers.0.block_sparse_moe.experts.{i}.w1.weight" for i in range(config.num_local_experts)]
    assert str(fused.parts[1].parts[0]) == "model.layers.0.block_sparse_moe.experts.0.w3.weight"


def test_without_rules_per_expert_keys_are_unexpected(checkpoint):
    directory, config = checkpoint("mixtral", "fp32")
    model = build_model("mixtral", config, torch.float32)
    bare = _mapping(directory, model, [], [])
    assert "model.layers.0.mlp.experts.gate_up_proj" in bare.missing
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in bare.unexpected
