"""Buffers a meta load does not read: recomputed as from_pretrained computes them (values and
dtypes), next to loaded weights that must stay the checkpoint's bytes; checkpoint keys of such
buffers (legacy position_ids, per-layer inv_freq) accepted and reported; what cannot be
computed refused before a byte is read."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from checkpoints import (assert_same_buffers, assert_same_ties, assert_same_weights, build_model, copy_checkpoint,
                         meta_tensors, outputs, reference_model, rewrite_tensor_in_checkpoint, shard_files)
from lazyload import LazyCheckpoint
from lazyload.errors import MetaBufferError


def load(directory, model, **kwargs):
    return LazyCheckpoint(str(directory)).load_into(model, progress=False, **kwargs)


def assert_checkpoint_bytes(model, directory):
    """Every checkpoint tensor is in the model as it was saved (keys renamed the way
    transformers renames them): no loaded weight was re-initialised."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [r for r in get_model_conversion_mapping(model) if isinstance(r, WeightRenaming)]
    state = model.state_dict()
    for path in shard_files(directory):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                name, _ = rename_source_key(key, renamings, [], model.base_model_prefix, state)
                saved = f.get_tensor(key)
                assert state[name].dtype == saved.dtype, f"{name}: {state[name].dtype} vs saved {saved.dtype}"
                assert torch.equal(state[name], saved), f"{name} differs from checkpoint tensor {key}"


# ------------------------------------------------------------- legacy buffer keys

@pytest.mark.parametrize("base", [False, True], ids=["bert", "minilm"])
def test_saved_position_ids_accepted_and_reported(checkpoint, tmp_path, base):
    """Published BERT / sentence-transformers (all-MiniLM-L6-v2: a bare BertModel) checkpoints
    carry embeddings.position_ids, now a non-persistent buffer. from_pretrained ignores the saved
    value and computes the buffer; so does lazyload, with default arguments, and reports the key."""
    directory, config = checkpoint("bert", "fp32", base=base)
    directory = copy_checkpoint(directory, tmp_path / "ckpt")
    key = "embeddings.position_ids" if base else "bert.embeddings.position_ids"
    # a value of its own, so that loading it instead of computing the buffer shows
    saved = torch.arange(config.max_position_embeddings).flip(0)[None]
    rewrite_tensor_in_checkpoint(directory, add={key: saved})

    model = build_model("bert", config, torch.float32, base=base)
    report = load(directory, model)

    assert report.ignored_buffer_keys == [key]
    assert report.unexpected == [] and report.missing == []
    assert key in str(report)
    ref = reference_model("bert", directory, torch.float32, base=base)
    assert_same_weights(model, ref)
    assert torch.equal(outputs(model, config), outputs(ref, config))


def test_per_layer_rotary_inv_freq_keys_accepted(checkpoint, tmp_path):
    """Older Llama checkpoints hold model.layers.N.self_attn.rotary_emb.inv_freq, a buffer the
    model no longer has there; from_pretrained drops such keys, lazyload too."""
    directory, config = checkpoint("llama", "fp32")
    directory = copy_checkpoint(directory, tmp_path / "ckpt")
    keys = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(config.num_hidden_layers)]
    rewrite_tensor_in_checkpoint(directory, add={k: torch.ones(8) for k in keys})

    model = build_model("llama", config, torch.float32)
    report = load(directory, model)

    assert report.ignored_buffer_keys == keys
    assert report.unexpected == []
    assert_same_weights(model, reference_model("llama", directory, torch.float32))


# ---------------------------------------------- buffers next to loaded weights

def _inputs(arch: str, config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if arch in ("clip", "siglip"):
        vision = config.vision_config
        return dict(input_ids=torch.randint(0, config.text_config.vocab_size, (2, 9), generator=g),
                    pixel_values=torch.randn(2, 3, vision.image_size, vision.image_size, generator=g))
    if arch == "llava":
        images = config.image_seq_length
    else:  # gemma3
        images = config.mm_tokens_per_image
    text = torch.randint(0, 90, (1, 6), generator=g)
    ids = torch.cat([text[:, :2], torch.full((1, images), config.image_token_id), text[:, 2:]], dim=1)
    size = config.vision_config.image_size
    return dict(input_ids=ids, pixel_values=torch.randn(1, 3, size, size, generator=g))


@torch.no_grad()
def _outputs(model, arch: str, config) -> list[torch.Tensor]:
    out = model(**_inputs(arch, config))
    if arch in ("clip", "siglip"):
        return [out.logits_per_image, out.text_embeds, out.image_embeds]
    return [out.logits]


@pytest.mark.parametrize("arch", ["clip", "siglip", "llava", "gemma3"])
def test_meta_load_matches_from_pretrained(checkpoint, arch):
    """position_ids of modules that own loaded embeddings (CLIP, SigLIP), vision towers that
    are sub-models with an init of their own (Llava, Gemma 3), Gemma 3's embed_scale: computed
    as from_pretrained computes them, while every loaded tensor stays the checkpoint's bytes."""
    directory, config = checkpoint(arch, "fp32")
    model = build_model(arch, config, torch.float32)

    report = load(directory, model)

    assert not meta_tensors(model)
    assert report.recomputed_buffers and report.ok
    assert_checkpoint_bytes(model, directory)
    ref = reference_model(arch, directory, torch.float32)
    assert_same_weights(model, ref)
    assert_same_ties(model, ref)
    for mine, theirs in zip(_outputs(model, arch, config), _outputs(ref, arch, config)):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("arch", ["groupvit", "xclip", "chinese_clip"])
def test_embeddings_with_buffers_keep_checkpoint_bytes(checkpoint, arch):
    """Text embeddings owning position_ids (and Chinese-CLIP's token_type_ids) next to loaded
    token, position and token-type embeddings: those stay the checkpoint's, the buffers are
    from_pretrained's. (Weights are compared with the checkpoint, not with from_pretrained:
    Chinese-CLIP's init zeroes the padding row of the loaded word embeddings in from_pretrained,
    the slice losing transformers' initialised flag; lazyload keeps the checkpoint's row.)"""
    directory, config = checkpoint(arch, "fp32")
    model = build_model(arch, config, torch.float32)

    report = load(directory, model)

    assert not meta_tensors(model)
    assert "text_model.embeddings.position_ids" in report.recomputed_buffers
    assert_checkpoint_bytes(model, directory)
    assert_same_buffers(model, reference_model(arch, directory, torch.float32))


def test_buffers_get_from_pretrained_dtype_after_cast(checkpoint):
    """A Llama-4 text model built on meta in float32, then cast with .to(bfloat16): from_pretrained
    (dtype=bfloat16) keeps the rotary inv_freq in float32, the constructor's dtype; so must the load."""
    directory, config = checkpoint("llama4_text", "bf16")
    model = build_model("llama4_text", config, torch.float32).to(torch.bfloat16)
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}

    load(directory, model)

    ref = reference_model("llama4_text", directory, torch.bfloat16)
    assert {b.dtype for b in ref.buffers()} == {torch.float32}
    assert_checkpoint_bytes(model, directory)
    assert_same_weights(model, ref)
    assert torch.equal(outputs(model, config), outputs(ref, config))


def test_buffers_get_from_pretrained_dtype_after_cast_with_checkpoint_config(checkpoint):
    """The same cast with the config read back from the bfloat16 checkpoint, so config.dtype says
    bfloat16 although the model was built in float32 and cast: the buffers' dtypes are decided
    from a fresh build, not from the config, and the logits are from_pretrained's."""
    import transformers as tf

    directory, _ = checkpoint("llama4_text", "bf16")
    config = tf.AutoConfig.from_pretrained(directory, attn_implementation="eager")
    assert config.dtype == torch.bfloat16
    with torch.device("meta"):
        model = tf.Llama4ForCausalLM(config).to(torch.bfloat16).eval()

    load(directory, model)

    ref = reference_model("llama4_text", directory, torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == model.model.rotary_emb.original_inv_freq.dtype == torch.float32
    assert_same_weights(model, ref)
    assert torch.equal(outputs(model, config), outputs(ref, config))


def test_buffers_get_from_pretrained_dtype_with_dtype_auto(checkpoint):
    """Built in float32, loaded with dtype="auto" from a bfloat16 checkpoint: from_pretrained
    (dtype=bfloat16) has Gemma 3's embed_scale in bfloat16 (made under the default dtype) but
    the rotary inv_freq in float32: the load gives each the same."""
    directory, config = checkpoint("gemma3", "bf16")
    model = build_model("gemma3", config, torch.float32)

    load(directory, model, dtype="auto")

    ref = reference_model("gemma3", directory, torch.bfloat16)
    assert ref.model.language_model.embed_tokens.embed_scale.dtype == torch.bfloat16
    assert ref.model.language_model.rotary_emb.sliding_attention_inv_freq.dtype == torch.float32
    assert_checkpoint_bytes(model, directory)
    assert_same_weights(model, ref)
    for mine, theirs in zip(_outputs(model, "gemma3", config), _outputs(ref, "gemma3", config)):
        assert torch.equal(mine, theirs)


# ------------------------------------------------ plain modules: the mechanism

class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4))
        self.register_buffer("scale", torch.empty(4), persistent=False)
        self.register_buffer("positions", torch.empty(8, dtype=torch.int64), persistent=False)


class Net(nn.Module):
    """Initialises like a transformers model, but with plain torch functions that know nothing of
    loaded weights: the owner's init draws its weight again, the root's computes a child's buffer."""

    def __init__(self, init_positions: bool = True, from_weight: bool = False):
        super().__init__()
        self.emb = Embeddings()
        self.head = nn.Linear(4, 2)
        self.init_positions = init_positions
        self.from_weight = from_weight

    def _init_weights(self, module):
        if isinstance(module, Embeddings):
            nn.init.normal_(module.weight)
            module.scale.copy_(module.weight[0] if self.from_weight else torch.linspace(1, 2, 4))
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, Net) and self.init_positions:
            module.emb.positions.copy_(torch.arange(8))


def _net_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {"emb.weight": torch.randn(8, 4, generator=g), "head.weight": torch.randn(2, 4, generator=g),
               "head.bias": torch.randn(2, generator=g)}
    save_file(tensors, str(tmp_path / "net.safetensors"))
    return tmp_path / "net.safetensors", tensors


def test_init_of_weight_owners_leaves_loaded_weights(tmp_path):
    path, tensors = _net_checkpoint(tmp_path)
    with torch.device("meta"):
        model = Net()

    report = load(path, model)

    for name, tensor in tensors.items():
        assert torch.equal(model.get_parameter(name), tensor), name
    assert torch.equal(model.emb.scale, torch.linspace(1, 2, 4))
    assert torch.equal(model.emb.positions, torch.arange(8))
    assert sorted(report.recomputed_buffers) == ["emb.positions", "emb.scale"]


@pytest.mark.parametrize("case", ["no init", "not computed", "needs a loaded value"])
def test_buffers_that_cannot_be_computed_are_refused_before_reading(tmp_path, case):
    path, _ = _net_checkpoint(tmp_path)
    with torch.device("meta"):
        model = Net(init_positions=case != "not computed", from_weight=case == "needs a loaded value")
    if case == "no init":
        model._init_weights = None
    before = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}

    with pytest.raises(MetaBufferError) as e:
        load(path, model)

    assert ("emb.positions" if case == "not computed" else "emb.scale") in str(e.value)
    assert "register them after the load" in str(e.value)
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    assert after.keys() == before.keys() and all(after[n] is t for n, t in before.items()), "model changed"


def test_buffers_are_refused_before_the_model_changes(tmp_path):
    """Quantizing on load swaps Linear layers before reading: a buffer that cannot be
    computed is refused before that, the model's modules and tensors as they were."""
    path, _ = _net_checkpoint(tmp_path)
    with torch.device("meta"):
        model = Net(init_positions=False)
    modules = dict(model.named_modules())
    before = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}

    with pytest.raises(MetaBufferError, match="emb.positions"):
        load(path, model, quantize="int8")

    assert dict(model.named_modules()) == modules and type(model.head) is nn.Linear, "a layer was swapped"
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    assert after.keys() == before.keys() and all(after[n] is t for n, t in before.items()), "model changed"
