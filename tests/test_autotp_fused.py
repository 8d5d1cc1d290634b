"""DeepSpeed AutoTP's fused layers: a fused qkv or gate_up layer is cut per part, so a rank's
local rows are its piece of q, of k and of v (of gate, of up) side by side, not one range of
the checkpoint tensor. `load_into` fills them with exactly the rows DeepSpeed gives the rank.

Without a process group: lazyload's box for each rank at worlds 2 and 3 is what DeepSpeed's
own split (`prepare_tp_fused_qkvw`, the per-part shard sizes of `GateUpPack_LinearLayer`)
makes of a real tensor. With DeepSpeed at world 2 (CPU, gloo): every tensor of a model AutoTP
made on meta and lazyload filled equals DeepSpeed's own load of the same checkpoint, and the
logits equal world 1's where DeepSpeed's AutoTP forward runs with these transformers models
(Falcon, CodeGen, GLM-4's gate_up_proj; Phi-3's and GPT-BigCode's attention read the unsplit
head count from the config and Bloom's alibi the unsplit heads, so DeepSpeed's own model fails
there too). Falcon and Bloom also tie lm_head to the embedding, which AutoTP cuts apart."""
from __future__ import annotations

import importlib.util
import os
import traceback

import pytest
import torch

from checkpoints import ATTN, fixed_input, randomize_
from gloo import end_rank, spawn_collecting
from lazyload import LazyCheckpoint, PlanError
from lazyload.plan import local_regions

# CI installs the test extra, DeepSpeed with it: there its absence fails instead of skipping.
HAS_DEEPSPEED = bool(os.environ.get("CI")) or importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is in the 'test' extra")

# arch -> (config fields, decoder layer class, its fused qkv layer's attribute path or None)
ARCHS = {
    "phi3": (dict(hidden_size=64, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, pad_token_id=0), "Phi3DecoderLayer", "self_attn.qkv_proj"),
    # Falcon and Bloom tie lm_head to the embedding, which AutoTP cuts (LmHeadLinearAllreduce):
    # at hidden 128 both ranks hold 64 columns, at 64 rank 0 holds them all and rank 1 none.
    "falcon": (dict(hidden_size=128, num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2, bias=True,
                    tie_word_embeddings=True), "FalconDecoderLayer", "self_attention.query_key_value"),
    "bloom": (dict(hidden_size=64, n_head=4, tie_word_embeddings=True), "BloomBlock", "self_attention.query_key_value"),
    "gpt_bigcode": (dict(n_embd=64, n_head=4, n_positions=64, multi_query=True), "GPTBigCodeBlock", "attn.c_attn"),
    "codegen": (dict(n_embd=64, n_head=8, n_positions=64, rotary_dim=4, bos_token_id=0, eos_token_id=0),
                "CodeGenBlock", "attn.qkv_proj"),
    "glm4": (dict(hidden_size=64, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, pad_token_id=0), "Glm4DecoderLayer", None),
}


def make_config(arch: str):
    import transformers

    fields, _, _ = ARCHS[arch]
    return transformers.AutoConfig.for_model(arch, **dict(vocab_size=256, num_hidden_layers=2,
                                                          tie_word_embeddings=False) | fields)


def save_checkpoint(arch: str, directory) -> str:
    """A small random `arch` causal LM, save_pretrained in several shards."""
    import transformers

    config = make_config(arch)
    config._attn_implementation = ATTN
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_(model)
    model.save_pretrained(directory, max_shard_size=40_000)
    return str(directory)


def _deepspeed_layers(arch: str):
    """DeepSpeed's fused layers for `arch`'s first decoder layer (built on meta, not split:
    no process group), and its AutoTP metadata."""
    import transformers
    from deepspeed.module_inject.layers import GateUpPack_LinearLayer, fused_LinearLayer
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    config = make_config(arch)
    meta = AutoTPMeta.from_model_config(config, tp_grain_size=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    block = next(m for m in model.modules() if type(m).__name__ == ARCHS[arch][1])
    layers = {}
    if ARCHS[arch][2]:
        layers["qkv"] = fused_LinearLayer(block.get_submodule(ARCHS[arch][2]), None, fused_module=block, tp_meta=meta)
    if hasattr(block.mlp, "gate_up_proj"):
        layers["gate_up"] = GateUpPack_LinearLayer(block.mlp.gate_up_proj, None, tp_meta=meta)
    return layers, meta


def _lazyload_rows(layer, full: torch.Tensor, local_rows: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of `full`, from lazyload's placement for the fused `layer`."""
    from lazyload.tp.autotp_fused import fused_kind, fused_placement

    placement = fused_placement("w", layer, fused_kind(layer), 0, tuple(full.shape), (local_rows, full.shape[1]),
                                rank, world)
    _, regions = local_regions("w", tuple(full.shape), placement, rank, world)
    return torch.cat([full[slice(*r.global_box[0])] for r in regions]) if regions else full[:0]


def _deepspeed_rows(kind: str, layer, meta, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    from deepspeed.module_inject.fusedqkv_utils import prepare_tp_fused_qkvw
    from deepspeed.module_inject.tp_shard import get_shard_size_list

    if kind == "qkv":
        return prepare_tp_fused_qkvw(layer.fused_module.fused_module, full, world, rank, meta)
    # GateUpPack_LinearLayer: each half cut by get_shard_size_list under the name "mlp"
    halves = full.chunk(2)
    return torch.cat([h.split(get_shard_size_list(h.shape[0], world, meta, "mlp"))[rank] for h in halves])


@needs_deepspeed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_rows_are_deepspeeds_split(arch, world):
    """Each rank's rows of a real tensor, by lazyload's box, are DeepSpeed's split of it;
    where DeepSpeed refuses the split (CodeGen at world 3), lazyload's is a PlanError."""
    layers, meta = _deepspeed_layers(arch)
    for kind, layer in layers.items():
        rows, cols = layer.weight.shape
        full = torch.randn(rows, cols)
        for rank in range(world):
            try:
                want = _deepspeed_rows(kind, layer, meta, full, rank, world)
            except AssertionError:  # DeepSpeed's own check: a head count the world does not divide
                with pytest.raises(PlanError, match="fused layer"):
                    _lazyload_rows(layer, full, rows // world, rank, world)
                continue
            assert torch.equal(_lazyload_rows(layer, full, want.shape[0], rank, world), want), (kind, rank)


@needs_deepspeed
def test_fused_local_shape_that_is_not_deepspeeds_cut_is_a_plan_error(tmp_path):
    """A fused layer holding a share DeepSpeed does not make fails before anything is read,
    naming the parameter, and leaves the model as it was."""
    import transformers

    directory = save_checkpoint("phi3", tmp_path / "ckpt")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(make_config("phi3"))
    layers, _ = _deepspeed_layers("phi3")
    layer = layers["qkv"]
    layer.weight = torch.nn.Parameter(layer.weight[:40], requires_grad=False)  # no rank holds 40 rows
    model.model.layers[0].self_attn.qkv_proj = layer
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight.*fused"):
        LazyCheckpoint(directory).load_into(model, 0, 2, progress=False)
    assert all(p.is_meta for p in model.parameters())


def _deepspeed_worker(rank, world, directories, init_file, errors):
    try:
        from deepspeed_models import init_deepspeed_rank

        init_deepspeed_rank(rank, world, init_file)  # builds no DeepSpeed op
        for arch, directory in directories.items():
            _check_against_deepspeed(arch, directory, rank, world)
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
    end_rank()


def _check_against_deepspeed(arch: str, directory: str, rank: int, world: int) -> None:
    import deepspeed
    import transformers

    def autotp(model):
        return deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                        replace_with_kernel_inject=False).module

    causal_lm = transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.from_pretrained(directory)
    theirs = autotp(causal_lm.from_pretrained(directory, dtype=torch.float32, attn_implementation=ATTN).eval())
    with torch.device("meta"):
        reference, ours = (causal_lm.from_config(config, dtype=torch.float32, attn_implementation=ATTN).eval()
                           for _ in range(2))
    ours = autotp(ours)
    report = LazyCheckpoint(directory).load_into(ours, rank, world, progress=False)
    assert report.ok and not report.missing, report
    theirs_params = dict(theirs.named_parameters())
    fused = 0
    for name, param in ours.named_parameters():
        fused += type(ours.get_submodule(name.rpartition(".")[0])).__name__ in ("fused_LinearLayer",
                                                                               "GateUpPack_LinearLayer")
        assert torch.equal(param, theirs_params[name]), f"{arch} rank {rank}: {name} is not DeepSpeed's"
    assert fused, f"{arch}: AutoTP made no fused layer"
    if arch in ("falcon", "codegen", "glm4"):  # DeepSpeed's AutoTP forward runs for these (module docstring)
        LazyCheckpoint(directory).load_into(reference, progress=False)  # world 1
        with torch.no_grad():
            got = ours(input_ids=fixed_input(config)).logits
            want = reference(input_ids=fixed_input(config)).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_deepspeed
def test_deepspeed_autotp_fused_layers_are_deepspeeds(tmp_path):
    directories = {arch: save_checkpoint(arch, tmp_path / arch) for arch in ARCHS}
    spawn_collecting(_deepspeed_worker, (2, directories, str(tmp_path / "pg")), 2)
