"""Whole families of transformers models, each built small by the architecture sweep
(benchmarks/sweep_architectures.py), saved in several shards, and loaded by lazyload into a
meta model: every parameter and buffer, and the outputs, equal `from_pretrained`'s.

Twenty families run by default; every class transformers ships runs with `-m slow`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep_architectures.py"
_spec = importlib.util.spec_from_file_location("sweep_architectures", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

FAMILIES = [
    "LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM",                        # decoder, tied head, encoder
    "T5ForConditionalGeneration", "BartForConditionalGeneration",                    # encoder-decoder
    "WhisperForConditionalGeneration", "ViTForImageClassification",                  # speech, vision
    "Qwen2VLForConditionalGeneration", "LlavaForConditionalGeneration",              # multimodal
    "Gemma3ForConditionalGeneration", "CLIPModel", "SiglipModel",                    # meta buffers of modules with weights
    "MambaForCausalLM", "JambaForCausalLM",                                          # state-space, hybrid
    "GraniteMoeHybridForCausalLM", "Gemma4ForCausalLM",                              # Mamba-2 hybrid, per-layer head_dim
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",  # MoE
]


@pytest.fixture(scope="module")
def classes():
    return {cls: model_type for model_type, cls in sweep.model_classes()}


def _check(model_type, cls, tmp_path):
    row = sweep.sweep_one(model_type, cls, str(tmp_path))
    assert row["outcome"] in ("exact", "from_pretrained fails"), f"{cls}: {row['outcome']}: {row['detail']}"
    return row


@pytest.mark.parametrize("cls", FAMILIES)
def test_family_loads_exactly_as_from_pretrained(classes, cls, tmp_path):
    row = _check(classes[cls], cls, tmp_path)
    assert row["outcome"] == "exact"


def test_sweep_tells_a_wrong_tensor_from_a_right_one(classes, tmp_path, monkeypatch):
    """The comparison itself: a load that changes one value is reported as differing."""
    import torch

    from lazyload import LazyCheckpoint

    load_into = LazyCheckpoint.load_into

    def off_by_one(self, model, *args, **kwargs):
        report = load_into(self, model, *args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1
        return report

    monkeypatch.setattr(LazyCheckpoint, "load_into", off_by_one)
    row = sweep.sweep_one(classes["LlamaForCausalLM"], "LlamaForCausalLM", str(tmp_path))
    assert row["outcome"] == "differs", row


def test_sweep_tells_from_pretrained_changing_the_saved_model(classes, tmp_path, monkeypatch):
    """The second witness: where `from_pretrained` loads a tensor unlike the model that was
    saved (transformers' renaming swaps PixioBackbone's two layer norms) while lazyload's load
    equals the saved model, the row blames `from_pretrained`, not lazyload."""
    import torch
    import transformers

    from_pretrained = transformers.LlamaForCausalLM.from_pretrained

    def off_by_one(cls, *args, **kwargs):
        model = from_pretrained(*args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1
        return model

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", classmethod(off_by_one))
    row = sweep.sweep_one(classes["LlamaForCausalLM"], "LlamaForCausalLM", str(tmp_path))
    assert row["outcome"] == "from_pretrained fails" and "round trip" in row["detail"], row


@pytest.mark.slow
def test_every_class_loads_as_from_pretrained(classes):
    """The whole sweep: every class that from_pretrained loads, lazyload loads exactly."""
    rows = sweep.run_all(sorted((t, c) for c, t in classes.items()), chunk=40, per_class=120)
    failed = [r for r in rows if r["outcome"] not in ("exact", "no small config", "from_pretrained fails")]
    assert not failed, sweep.format_table(rows)


def test_tensors_the_model_expects_missing_get_its_init(classes, tmp_path):
    """Marian's sinusoidal `embed_positions`: parameters the checkpoint does not hold and the
    model lists in `_keys_to_ignore_on_load_missing`. A strict load is no error and gives them
    from_pretrained's values (the sweep compares every tensor: the model's init);
    missing="keep" leaves them on meta."""
    import torch
    import transformers

    from lazyload import LazyCheckpoint

    assert _check(classes["MarianMTModel"], "MarianMTModel", tmp_path)["outcome"] == "exact"
    directory = tmp_path / "MarianMTModel"
    positions = ["model.decoder.embed_positions.weight", "model.encoder.embed_positions.weight"]
    config = transformers.MarianConfig.from_pretrained(directory)
    for missing in ("init", "keep"):
        with torch.device("meta"):
            model = transformers.MarianMTModel(config)
        report = LazyCheckpoint(directory).load_into(model, missing=missing, progress=False)
        assert report.ok and not report.missing
        assert sorted(report.initialized) == (positions if missing == "init" else [])
        assert [model.get_parameter(n).is_meta for n in positions] == [missing == "keep"] * 2


def test_shrink_makes_valid_configs_of_defaults_that_leave_sizes_unset():
    """Default configs the sweep could not shrink before: GLM's eos ids are a list (renumbered
    below the small vocab), Ministral's head_dim and Nemotron's KV head count are None (set as
    other models derive them), Xcodec's hidden_size is a read-only property (left to derive),
    DBRX's attention reads a rope_theta its config lacks (given)."""
    import transformers

    glm = sweep.shrink(transformers.GlmConfig())
    assert isinstance(glm.eos_token_id, list) and all(i < glm.vocab_size for i in glm.eos_token_id)
    ministral = sweep.shrink(transformers.MinistralConfig())
    assert ministral.head_dim * ministral.num_attention_heads == ministral.hidden_size
    nemotron = sweep.shrink(transformers.NemotronConfig())
    assert nemotron.num_attention_heads % nemotron.num_key_value_heads == 0
    xcodec = sweep.shrink(transformers.XcodecConfig())
    assert xcodec.acoustic_model_config.hidden_size <= sweep.SMALL["hidden_size"]
    assert sweep.shrink(transformers.DbrxConfig()).attn_config.rope_theta > 0
