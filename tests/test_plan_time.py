"""Plan time (issue 22 item 6): the short cuts that keep DeepSeek-V3's plan well under one
CPU second per rank give the answers of the long way. The plans themselves are pinned by
tests/test_scale.py's digests; the CPU seconds are measured by benchmarks/bench_scale.py."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model
from lazyload import LazyCheckpoint
from lazyload.expr import Cat, Chunk, Dequant, Source, Stack, Transpose, Whole
from lazyload.hf_rules import HFRename, hf_rules
from lazyload.mapping import TargetSpec, build_mapping


@pytest.fixture
def mixtral(checkpoint):
    """(index, specs, model) of a Mixtral checkpoint: per-expert keys, fused in the model."""
    directory, config = checkpoint("mixtral", "fp32")
    model = build_model("mixtral", config, torch.float32)
    specs = {n: TargetSpec(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    return LazyCheckpoint(str(directory)).index, specs, model


def test_the_rule_less_pass_gives_up_at_a_key_that_stays_unexpected(mixtral):
    index, specs, model = mixtral
    prefix = model.base_model_prefix
    assert build_mapping(index, specs, base_prefix=prefix).unexpected  # per-expert keys, without the rules
    assert build_mapping(index, specs, base_prefix=prefix, give_up_unexpected=True) is None


@pytest.mark.parametrize("leave_out", [{"ignore_unexpected": [r"\.block_sparse_moe\."]},
                                       {"other_stage": lambda key: ".block_sparse_moe." in key}])
def test_keys_that_do_not_stay_unexpected_do_not_make_it_give_up(mixtral, leave_out):
    """Ignored keys and another pipeline stage's are no reason to map again: the pass goes
    on to the mapping it gives without giving up."""
    index, specs, model = mixtral
    prefix = model.base_model_prefix
    mapping = build_mapping(index, specs, base_prefix=prefix, give_up_unexpected=True, **leave_out)
    assert mapping == build_mapping(index, specs, base_prefix=prefix, **leave_out)
    assert not mapping.unexpected and mapping.missing  # the fused experts, which the rules would fill


def test_a_rename_answers_as_transformers_does(mixtral):
    from transformers.core_model_loading import WeightRenaming

    index, _, model = mixtral
    renames, _ = hf_rules(model)
    scoped = WeightRenaming(source_patterns="^mlp", target_patterns="ffn")
    scoped.scope_prefix = "model.layers.0"  # matched after the scope: not by its own regex on the whole key
    keys = list(index.keys()) + ["encoder.LayerNorm.gamma", "a.LayerNorm.beta_x", "conv.weight_g", "model.layers.0.mlp.gate"]
    for rename in [*renames, HFRename(scoped)]:
        assert [rename.apply(k) for k in keys] == [rename.transform.rename_source_key(k)[0] for k in keys], rename
    assert HFRename(scoped).apply("model.layers.0.mlp.gate") == "model.layers.0.ffn.gate"


def test_first_key_is_the_first_of_keys():
    experts = [Dequant(f"e.{i}.weight", f"e.{i}.weight_scale_inv", (128, 128)) for i in range(3)]
    exprs = [Source("a"), Stack(tuple(experts)), Cat((Stack(tuple(experts[1:])), Source("b")), 1),
             Chunk(Cat((Source("c"), Source("d"))), 0, 1, 2), Transpose(Source("t")),
             Whole(((0, Stack((Source("w0"), Source("w1")))),), "out", lambda tensors: {})]
    assert [e.first_key() for e in exprs] == [e.keys()[0] for e in exprs] == [
        "a", "e.0.weight", "e.1.weight", "c", "t", "w0"]
