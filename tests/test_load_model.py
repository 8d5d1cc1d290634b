"""`lazyload.load_model(path)`: the model config.json describes, built on meta and loaded,
equals `from_pretrained(path, dtype="auto")`."""
from __future__ import annotations

import shutil

import pytest
import torch

from checkpoints import ATTN, assert_same_ties, assert_same_weights, outputs, reference_model
from lazyload import CheckpointError, load_model


@pytest.mark.parametrize("arch,dt", [("llama", "bf16"), ("gpt2", "fp32"), ("mixtral", "bf16")])
def test_load_model_equals_from_pretrained_auto(checkpoint, arch, dt):
    directory, config = checkpoint(arch, dt)
    model, report = load_model(directory, model_kwargs={"attn_implementation": ATTN}, progress=False)
    ref = reference_model(arch, directory, "auto")
    assert report.ok and type(model) is type(ref)
    assert next(model.parameters()).dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    assert_same_weights(model, ref)
    assert_same_ties(model, ref)
    assert torch.equal(outputs(model, config), outputs(ref, config))


def test_load_model_casts_and_takes_a_class_by_name(checkpoint):
    directory, config = checkpoint("llama", "bf16")
    model, report = load_model(directory, dtype=torch.float16, model_class="LlamaModel", strict=False,
                               progress=False)
    assert type(model).__name__ == "LlamaModel" and report.unexpected == ["lm_head.weight"]
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    ref = reference_model("llama", directory, torch.float16, base=True)
    assert_same_weights(model, ref)


def test_load_model_shards_by_rank(checkpoint):
    directory, config = checkpoint("llama", "fp32")
    model, report = load_model(directory, 1, 2, progress=False)
    q = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert q.shape[0] == config.num_attention_heads * config.head_dim // 2 and report.world == 2


def test_load_model_without_config_json_says_what_to_do(checkpoint, tmp_path):
    directory, _ = checkpoint("llama", "fp32")
    for f in directory.iterdir():
        if f.name != "config.json":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(CheckpointError, match="no config.json.*config="):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="no class 'LlamaForCausalLMX'"):
        load_model(directory, model_class="LlamaForCausalLMX")
