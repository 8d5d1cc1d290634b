"""A new user's first mistakes get an answer that says what to do: a misspelt keyword of
load_model, a dtype given by name, LazyCheckpoint's arguments swapped, a config with another
layer count than the checkpoint; and what quantize= did is in print(report)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model
from lazyload import (ArgumentError, DtypeError, LazyCheckpoint, MissingKeysError, Quantization, UnexpectedKeysError,
                      load_model)


def test_load_model_refuses_an_unknown_keyword_first_and_suggests_the_name(checkpoint, tmp_path):
    directory, _ = checkpoint("llama")
    with pytest.raises(ArgumentError, match=r"unknown keyword 'quantise'; did you mean 'quantize'\?"):
        load_model(directory, quantise="int8")
    # Checked before anything else: before the path is even looked at, let alone a model built.
    with pytest.raises(ArgumentError, match=r"'model_kwarg'; did you mean 'model_kwargs'\?"):
        load_model(tmp_path / "nowhere", model_kwarg={})


@pytest.mark.parametrize("name,want", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                       ("float16", torch.float16), ("torch.float32", torch.float32)])
def test_dtype_names_are_taken_by_load_model_and_load_into(checkpoint, name, want):
    directory, config = checkpoint("llama")
    model, report = load_model(directory, dtype=name, progress=False)
    assert report.ok and {p.dtype for p in model.parameters()} == {want}
    meta = build_model("llama", config, torch.float32)
    assert LazyCheckpoint(directory).load_into(meta, dtype=name, progress=False).ok
    assert {p.dtype for p in meta.parameters()} == {want}
    ref = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, dtype=want, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(meta.state_dict().values(), ref.state_dict().values()))


def test_an_unknown_dtype_name_says_which_names_work(checkpoint):
    directory, config = checkpoint("llama")
    meta = build_model("llama", config, torch.float32)
    with pytest.raises(DtypeError, match="'bfloat16'"):
        load_model(directory, dtype="bfloat61", progress=False)
    with pytest.raises(DtypeError, match="'bfloat16'"):
        LazyCheckpoint(directory).load_into(meta, dtype="brain", progress=False)
    assert all(p.is_meta for p in meta.parameters())


def test_swapped_lazycheckpoint_arguments_say_what_goes_where(checkpoint):
    _, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    with pytest.raises(ArgumentError, match=r"got a LlamaForCausalLM \(a model: it goes to load_into\).*"
                                            r"LazyCheckpoint\(path\)\.load_into\(model"):
        LazyCheckpoint(model)
    with pytest.raises(ArgumentError, match="got a int"):
        LazyCheckpoint(["a.safetensors", 3])


def test_a_model_with_more_layers_than_the_checkpoint_says_to_check_the_config(checkpoint):
    directory, config = checkpoint("llama")
    have = config.num_hidden_layers
    deeper = build_model("llama", type(config).from_dict({**config.to_dict(), "num_hidden_layers": have + 2}),
                         torch.float32)
    with pytest.raises(MissingKeysError) as missing:
        LazyCheckpoint(directory).load_into(deeper, progress=False)
    first = str(missing.value).splitlines()[0]
    assert first == (f"The model has {have + 2} layers and the checkpoint {have} (model.layers): check the config "
                     "(num_hidden_layers, or n_layer / num_layers) matches the checkpoint's config.json.")
    assert "did you mean" not in str(missing.value)
    shallower = build_model("llama", type(config).from_dict({**config.to_dict(), "num_hidden_layers": have - 1}),
                            torch.float32)
    with pytest.raises(UnexpectedKeysError, match=f"The model has {have - 1} layers and the checkpoint {have} "):
        LazyCheckpoint(directory).load_into(shallower, progress=False)


def test_printed_report_says_what_was_quantized_and_the_bytes_saved(checkpoint):
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, quantize=Quantization("int8", torchao=False), progress=False)
    layers = config.num_hidden_layers
    assert report.quantized_to == "int8, a float32 scale per 128 input columns"
    linears = {n for n, m in model.named_modules() if type(m).__name__ == "QuantizedLinear"}
    assert set(report.quantized) == linears and "lm_head" not in linears and len(linears) == 7 * layers
    # Each weight: 4 bytes per element in float32, now 1, plus a float32 scale per group of 128.
    saved = sum(m.weight.numel() * 3 - m.weight_scale.nbytes for n, m in model.named_modules() if n in linears)
    assert report.bytes_saved == saved > 0
    text = str(report)
    assert "quantized to int8, a float32 scale per 128 input columns" in text
    assert f"model.layers.{{0...{layers - 1}}}.self_attn.q_proj  x{layers}" in text
