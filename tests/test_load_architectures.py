"""LazyCheckpoint.load_into against transformers' from_pretrained, on real checkpoints of
several architectures: every tensor, every buffer, ties and logits identical."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (ARCHS, DTYPES, assert_same_ties, assert_same_weights, build_model,
                         meta_tensors, outputs, reference_model, shard_files)
from lazyload import LazyCheckpoint, LoadReport
from lazyload.errors import LazyLoadError, MissingKeysError, UnexpectedKeysError

ARCH_DTYPES = [(a, d) for a in ARCHS for d in DTYPES]


def load(directory, model, **kwargs) -> LoadReport:
    return LazyCheckpoint(str(directory)).load_into(model, progress=False, **kwargs)


def assert_matches_reference(model, ref, config):
    assert_same_weights(model, ref)
    assert_same_ties(model, ref)
    assert torch.equal(outputs(model, config), outputs(ref, config))


@pytest.mark.parametrize("arch,dt", ARCH_DTYPES)
def test_meta_model_matches_from_pretrained(checkpoint, arch, dt):
    directory, config = checkpoint(arch, dt)
    dtype = DTYPES[dt]
    model = build_model(arch, config, dtype, empty="meta")
    assert meta_tensors(model)

    report = load(directory, model)

    ref = reference_model(arch, directory, dtype)
    assert_matches_reference(model, ref, config)
    assert isinstance(report, LoadReport)
    assert report.missing == [] and report.unexpected == [] and report.mismatched == []
    params = {n for n, _ in model.named_parameters()}
    assert params <= set(report.loaded), sorted(params - set(report.loaded))


def test_gpt2_tied_lm_head_is_wte(checkpoint):
    directory, config = checkpoint("gpt2", "fp32")
    assert not any(k.startswith("lm_head") for k in LazyCheckpoint(str(directory)).keys())
    model = build_model("gpt2", config, torch.float32)
    load(directory, model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.lm_head.weight.is_meta


def test_bert_decoder_tied_to_word_embeddings(checkpoint):
    directory, config = checkpoint("bert", "fp32")
    model = build_model("bert", config, torch.float32)
    load(directory, model)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    # non-persistent integer buffers are not in the checkpoint: recomputed, not cast
    pos = model.bert.embeddings.position_ids
    assert pos.dtype == torch.int64 and not pos.is_meta
    assert torch.equal(pos, torch.arange(config.max_position_embeddings)[None])


@pytest.mark.parametrize("arch", ["llama", "mixtral", "llama4_text"])
def test_rotary_inv_freq_recomputed(checkpoint, arch):
    directory, config = checkpoint(arch, "bf16")
    model = build_model(arch, config, torch.bfloat16)
    load(directory, model)
    ref = reference_model(arch, directory, torch.bfloat16)
    for name, buf in ref.named_buffers():
        if "inv_freq" in name:
            mine = model.get_buffer(name)
            assert not mine.is_meta
            assert mine.dtype == buf.dtype, name
            assert torch.equal(mine, buf), name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_accelerate_init_empty_weights(checkpoint, arch):
    directory, config = checkpoint(arch, "fp32")
    model = build_model(arch, config, torch.float32, empty="accelerate")
    assert any(p.is_meta for p in model.parameters())
    load(directory, model)
    ref = reference_model(arch, directory, torch.float32)
    assert_matches_reference(model, ref, config)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_real_model_overwritten_in_place(checkpoint, arch):
    directory, config = checkpoint(arch, "fp32")
    model = build_model(arch, config, torch.float32, empty=None, seed=99)
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    ref = reference_model(arch, directory, torch.float32)
    assert not torch.equal(outputs(model, config), outputs(ref, config))

    load(directory, model)

    for n, p in model.named_parameters():
        obj, ptr = before[n]
        assert p is obj, f"{n}: parameter object replaced"
        assert p.data_ptr() == ptr, f"{n}: storage replaced, not overwritten in place"
    assert_matches_reference(model, ref, config)


def test_dtype_auto_keeps_checkpoint_dtype(checkpoint):
    directory, config = checkpoint("llama", "bf16")
    model = build_model("llama", config, torch.float32)  # model says fp32, checkpoint bf16
    load(directory, model, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_matches_reference(model, reference_model("llama", directory, torch.bfloat16), config)


def test_dtype_none_keeps_model_dtype(checkpoint):
    directory, config = checkpoint("qwen2", "bf16")
    model = build_model("qwen2", config, torch.float32)
    load(directory, model)  # dtype=None: cast bf16 checkpoint into the fp32 model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_matches_reference(model, reference_model("qwen2", directory, torch.float32), config)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_explicit_dtype_float16(checkpoint, arch):
    directory, config = checkpoint(arch, "bf16")
    model = build_model(arch, config, torch.float32)
    load(directory, model, dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    ref = reference_model(arch, directory, torch.float16)
    assert_matches_reference(model, ref, config)
    if arch == "bert":  # integer buffers are not "floating params": untouched by dtype
        assert model.bert.embeddings.position_ids.dtype == torch.int64


# ------------------------------------------------------------------ base_model_prefix

def test_bert_base_model_from_masked_lm_checkpoint(checkpoint):
    """BertModel from a BertForMaskedLM checkpoint (keys "bert.*" plus head "cls.*")."""
    directory, config = checkpoint("bert", "fp32")
    model = build_model("bert", config, torch.float32, base=True, add_pooling_layer=False)
    report = load(directory, model, strict=False)
    assert report.missing == []
    assert report.unexpected and all("cls.predictions" in k for k in report.unexpected), report.unexpected
    ref = reference_model("bert", directory, torch.float32, base=True, add_pooling_layer=False)
    assert_matches_reference(model, ref, config)


def test_bert_base_model_from_masked_lm_checkpoint_strict(checkpoint):
    directory, config = checkpoint("bert", "fp32")
    model = build_model("bert", config, torch.float32, base=True, add_pooling_layer=False)
    with pytest.raises(UnexpectedKeysError, match=r"cls\.predictions") as e:
        load(directory, model)
    assert isinstance(e.value, LazyLoadError)
    assert all(p.is_meta for p in model.parameters())


def test_causal_lm_from_bare_base_checkpoint_tied(checkpoint):
    """LlamaForCausalLM (tied) from a checkpoint written by a bare LlamaModel."""
    directory, config = checkpoint("llama", "fp32", base=True, tie_word_embeddings=True)
    assert not any(k.startswith("model.") for k in LazyCheckpoint(str(directory)).keys())
    model = build_model("llama", config, torch.float32)
    report = load(directory, model)
    assert report.missing == [] and report.unexpected == []
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_matches_reference(model, reference_model("llama", directory, torch.float32), config)


def test_causal_lm_from_bare_base_checkpoint_untied(checkpoint):
    directory, config = checkpoint("llama", "fp32", base=True)
    assert not config.tie_word_embeddings
    model = build_model("llama", config, torch.float32)
    with pytest.raises(MissingKeysError, match=r"lm_head\.weight") as e:
        load(directory, model)
    assert "lm_head.weight" in e.value.keys
    assert all(p.is_meta for p in model.parameters()), "strict failure must leave the model untouched"

    model = build_model("llama", config, torch.float32)
    report = load(directory, model, strict=False)
    assert report.missing == ["lm_head.weight"]
    assert report.unexpected == []
    base_ref = reference_model("llama", directory, torch.float32, base=True)
    assert_same_weights(model.model, base_ref)


def test_base_model_from_causal_lm_checkpoint(checkpoint):
    """The reverse: LlamaModel from a LlamaForCausalLM checkpoint ("model.*" keys)."""
    directory, config = checkpoint("llama", "bf16", tie_word_embeddings=True)
    model = build_model("llama", config, torch.bfloat16, base=True)
    report = load(directory, model)
    assert report.missing == [] and report.unexpected == []
    ref = reference_model("llama", directory, torch.bfloat16, base=True)
    assert_matches_reference(model, ref, config)


def test_base_model_from_untied_causal_lm_checkpoint_reports_lm_head(checkpoint):
    directory, config = checkpoint("llama", "fp32")
    model = build_model("llama", config, torch.float32, base=True)
    report = load(directory, model, strict=False)
    assert report.unexpected == ["lm_head.weight"]
    assert report.missing == []
    assert_same_weights(model, reference_model("llama", directory, torch.float32, base=True))


# ------------------------------------------------------------------------- key_map

@pytest.fixture(scope="module")
def renamed_llama(checkpoint, tmp_path_factory):
    """The llama checkpoint with "model." renamed "decoder.", re-written with save_file
    in two files (no index json)."""
    directory, config = checkpoint("llama", "fp32")
    tensors = {}
    for f in shard_files(directory):
        tensors.update(load_file(str(f)))
    renamed = {re.sub(r"^model\.", "decoder.", k): v for k, v in tensors.items()}
    out = tmp_path_factory.mktemp("renamed")
    keys = sorted(renamed)
    half = len(keys) // 2
    save_file({k: renamed[k] for k in keys[:half]}, str(out / "part-a.safetensors"))
    save_file({k: renamed[k] for k in keys[half:]}, str(out / "part-b.safetensors"))
    return out, directory, config


@pytest.mark.parametrize("kind", ["dict", "callable"])
def test_key_map(renamed_llama, kind):
    out, original, config = renamed_llama
    assert any(k.startswith("decoder.") for k in LazyCheckpoint(str(out)).keys())
    key_map = ({r"^decoder\.": "model."} if kind == "dict"
               else (lambda k: re.sub(r"^decoder\.", "model.", k)))
    model = build_model("llama", config, torch.float32)
    report = load(out, model, key_map=key_map)
    assert report.missing == [] and report.unexpected == []
    assert_matches_reference(model, reference_model("llama", original, torch.float32), config)


def test_renamed_keys_without_key_map_fail(renamed_llama):
    out, _, config = renamed_llama
    model = build_model("llama", config, torch.float32)
    with pytest.raises(LazyLoadError):
        load(out, model)
    assert all(p.is_meta for p in model.parameters())


# -------------------------------------------------------------------------- report

def test_report_fields(checkpoint):
    directory, config = checkpoint("llama", "fp32")
    ckpt = LazyCheckpoint(str(directory))
    model = build_model("llama", config, torch.float32)
    report = ckpt.load_into(model, progress=False)
    params = {n for n, _ in model.named_parameters()}
    assert params <= set(report.loaded)
    assert report.missing == [] and report.unexpected == [] and report.mismatched == []
    # every tensor of this checkpoint is used exactly once by a world=1 load: read (copied)
    # or, same dtype on CPU, left as a view of the file mapping
    assert report.bytes_read + report.bytes_mapped == ckpt.total_bytes
    assert report.seconds >= 0
    assert isinstance(report.peak_rss, int) and report.peak_rss > 0
    assert isinstance(report.peak_anon, int) and report.peak_anon >= 0
    text = str(report)
    if report.bytes_mapped:
        assert "mapped" in text
    n = config.num_hidden_layers
    # layers are grouped "layers.{0...N}", not listed one by one
    assert f"layers.{{0...{n - 1}}}." in text, text
    assert "layers.1." not in text, text


@pytest.mark.parametrize("reader", ["mmap", "pread"])
def test_same_dtype_cpu_load_maps_with_mmap_and_copies_with_pread(checkpoint, tmp_path, reader):
    """On CPU in the checkpoint's dtype the mmap reader leaves parameters as copy-on-write
    views of the file mapping (as from_pretrained does); pread copies. Either way the values
    are the checkpoint's, survive the reader closing, and writing them never changes the file."""
    from checkpoints import copy_checkpoint

    directory, config = checkpoint("llama", "fp32")
    directory = copy_checkpoint(directory, tmp_path / "ckpt")
    ckpt = LazyCheckpoint(str(directory))
    model = build_model("llama", config, torch.float32)
    report = ckpt.load_into(model, progress=False, reader=reader)
    if reader == "mmap":
        assert report.bytes_mapped == ckpt.total_bytes and report.bytes_read == 0
    else:
        assert report.bytes_read == ckpt.total_bytes and report.bytes_mapped == 0
    ref = reference_model("llama", directory, torch.float32)
    import gc
    gc.collect()
    assert_matches_reference(model, ref, config)

    before = {p.name: p.read_bytes() for p in shard_files(directory)}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert {p.name: p.read_bytes() for p in shard_files(directory)} == before
    reloaded = build_model("llama", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(reloaded, progress=False, reader=reader)
    assert_same_weights(reloaded, ref)
