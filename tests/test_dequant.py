"""Pre-quantized checkpoints (FP8 block-scaled, compressed-tensors int8 / fp8) loaded into a
plain full-precision model: every quantized weight equals `(q.float() * scale_of_its_block)
.to(dtype)` exactly (the reference expands the scale grid with repeat_interleave and crops
it), on every rank's slice, for slices that start and end inside a block; the scales are
never unexpected keys, and a quantized weight is never cast without them."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from checkpoints import (EXPERTS_TP, build_model, copy_checkpoint, default_experts, edit_tensor, meta_tensors,
                         reference_model, shard_files)
from lazyload import LazyCheckpoint, Placement
from lazyload.errors import CheckpointError, CorruptValuesError
from lazyload.expr import Dequant, box_shape
from lazyload.quant.dequant import QuantizedBox, dequantize_into
from quant_checkpoints import (FP8, dequantize, quantize_fp8_blocks, write_compressed_checkpoint,
                               write_fp8_checkpoint)
from test_tp import shard_of

# Dims that are not multiples of 128: q_proj of 384 rows (96 per rank at world 4, rank 1
# starting inside block 0), an MLP of 1000 (slices of 500 and 250 starting inside blocks).
LLAMA = dict(hidden_size=384, intermediate_size=1000, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)


def read_all(directory) -> dict[str, torch.Tensor]:
    raw = {}
    for path in shard_files(directory):
        raw.update(load_file(str(path)))
    return raw


def expected_tensors(directory, dtype, block=(128, 128)) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as the model should hold it: quantized weights dequantized
    by the reference formula (`block`: None for a whole dim), the others cast."""
    raw = read_all(directory)
    out = {}
    for key, tensor in raw.items():
        scale = raw.get(key + "_scale_inv", raw.get(key + "_scale"))
        if scale is not None:
            out[key] = dequantize(tensor, scale, block, dtype, raw.get(key + "_zero_point"))
        elif not key.endswith(("_scale_inv", "_scale", "_zero_point")):
            out[key] = tensor.to(dtype)
    return out


@pytest.fixture(scope="module")
def fp8_llama(checkpoint, tmp_path_factory):
    src, config = checkpoint("llama", "bf16", **LLAMA)
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("llama-fp8")), config


def check_rank(model, expected, rank, world, kv):
    for name, param in model.named_parameters():
        want = shard_of(name, expected[name], rank, world, kv)
        assert torch.equal(param.detach(), want), f"rank {rank} of {world}: {name}"


@pytest.mark.parametrize("world,reader", [(1, "auto"), (2, "auto"), (4, "auto"), (4, "pread")])
def test_fp8_block_llama_equals_the_formula_on_every_rank(fp8_llama, world, reader):
    directory, config = fp8_llama
    expected = expected_tensors(directory, torch.bfloat16)
    assert expected["model.layers.0.mlp.down_proj.weight"].shape == (384, 1000)
    for rank in range(world):
        model = build_model("llama", config, torch.bfloat16)
        report = LazyCheckpoint(str(directory)).load_into(model, rank, world, reader=reader, progress=False)
        assert report.ok and not report.unexpected and not meta_tensors(model)
        check_rank(model, expected, rank, world, config.num_key_value_heads)


def test_fp8_into_float32_and_auto_dtype(fp8_llama):
    """The target dtype is the model's (or dtype=); "auto" gives the model's dtype to a
    dequantized weight (its checkpoint dtype, float8, holds no values of its own)."""
    directory, config = fp8_llama
    model = build_model("llama", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, progress=False)
    check_rank(model, expected_tensors(directory, torch.float32), 0, 1, config.num_key_value_heads)
    model = build_model("llama", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, dtype="auto", progress=False)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # a plain bf16 tensor: the checkpoint's


def test_equals_transformers_dequantization_where_transformers_is_exact(checkpoint, tmp_path):
    """With every dim a multiple of 128, transformers' own CPU dequantization (from_pretrained
    of the FP8 checkpoint) is the same formula: the models are equal bit for bit."""
    src, config = checkpoint("llama", "bf16", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    directory = write_fp8_checkpoint(src, tmp_path / "fp8")
    ref = reference_model("llama", directory, torch.bfloat16)
    model = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(directory)).load_into(model, progress=False)
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sorted(sd) == sorted(rsd)
    for key in rsd:
        assert torch.equal(sd[key], rsd[key]), key


class Proj(nn.Module):
    """DeepSeek's kv_a_proj_with_mqa shape: 576 rows (4.5 blocks), 1000 columns."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(1000, 576, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_proj(tmp_path_factory):
    directory = tmp_path_factory.mktemp("proj-fp8")
    generator = torch.Generator().manual_seed(0)
    q, scale_inv = quantize_fp8_blocks(torch.randn(576, 1000, generator=generator) * 0.05)
    bias = torch.randn(576, generator=generator).to(torch.bfloat16)
    save_file({"proj.weight": q, "proj.weight_scale_inv": scale_inv, "proj.bias": bias},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    return directory, dequantize(q, scale_inv, (128, 128), torch.bfloat16), bias


@pytest.mark.parametrize("reader,release_pages", [("mmap", False), ("mmap", True), ("pread", False)])
def test_slices_starting_and_ending_inside_blocks(fp8_proj, reader, release_pages):
    """Rows 144:288 at world 4 start in block 1 and end in block 2; columns 250:500 too."""
    directory, weight, bias = fp8_proj
    for world in (1, 2, 4):
        for dim in (0, 1):
            for rank in range(world):
                with torch.device("meta"):
                    model = Proj()
                report = LazyCheckpoint(str(directory)).load_into(
                    model, rank, world, plan={"proj.weight": Placement("shard", dim)}, reader=reader,
                    release_pages=release_pages, progress=False)
                assert report.ok
                assert torch.equal(model.proj.weight.detach(), weight.chunk(world, dim)[rank]), (world, dim, rank)
                assert torch.equal(model.proj.bias.detach(), bias)


def test_a_rank_reads_only_the_scale_blocks_covering_its_slice(fp8_proj):
    directory, _, _ = fp8_proj
    with torch.device("meta"):
        model = Proj()
    report = LazyCheckpoint(str(directory)).load_into(model, 1, 4, plan={"proj.weight": Placement("shard", 0)},
                                                      reader="pread", progress=False)
    rows = 576 // 4  # rows 144:288 lie in scale rows 1 and 2, all 8 columns of each
    assert report.bytes_read == rows * 1000 + 2 * 8 * 4 + 576 * 2


@pytest.mark.parametrize("num_type,strategy,group_size,symmetric,static_input", [
    ("int", "channel", None, True, False),     # int8 per channel, no zero point
    ("int", "channel", None, False, False),    # asymmetric: weight_zero_point
    ("int", "group", 128, True, False),        # groups of 128 over 1000 columns: the last one partial
    ("float", "tensor", None, True, True),     # fp8 per tensor, with a static input_scale
])
def test_compressed_tensors(checkpoint, tmp_path, num_type, strategy, group_size, symmetric, static_input):
    src, config = checkpoint("llama", "bf16", **LLAMA)
    directory = write_compressed_checkpoint(src, tmp_path / "ct", num_type, strategy, group_size, symmetric,
                                            static_input)
    raw = read_all(directory)
    key = "model.layers.1.mlp.down_proj.weight"
    assert raw[key].dtype == (torch.int8 if num_type == "int" else FP8)
    assert (key + "_zero_point" in raw) == (not symmetric)
    block = {"channel": (1, None), "group": (1, 128), "tensor": (None, None)}[strategy]
    for world in (1, 4):
        for rank in range(world):
            model = build_model("llama", config, torch.bfloat16)
            report = LazyCheckpoint(str(directory)).load_into(model, rank, world, progress=False)
            assert report.ok and not report.unexpected
            want = dequantize(raw[key], raw[key + "_scale"], block, torch.bfloat16, raw.get(key + "_zero_point"))
            assert torch.equal(model.get_parameter(key).detach(), want.chunk(world, 1)[rank])
            if world == 1:
                check_rank(model, expected_tensors(directory, torch.bfloat16, block), 0, 1, config.num_key_value_heads)


def test_mixtral_experts_stacked_from_quantized_per_expert_weights(checkpoint, tmp_path):
    """Per-expert FP8 weights (blocks of 16 declared in config.json) gathered by transformers'
    conversion (stack, concatenate gate and up) into 3-D experts, then TP and EP slices."""
    src, config = checkpoint("mixtral", "bf16")
    directory = write_fp8_checkpoint(src, tmp_path / "fp8", block=(16, 16), names=("w1", "w2", "w3"))
    raw = read_all(directory)
    expert = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    dq = {(e, w): dequantize(raw[expert.format(e, w)], raw[expert.format(e, w) + "_scale_inv"], (16, 16),
                             torch.bfloat16) for e in range(config.num_local_experts) for w in ("w1", "w2", "w3")}
    gate_up = torch.stack([torch.cat([dq[e, "w1"], dq[e, "w3"]]) for e in range(config.num_local_experts)])
    down = torch.stack([dq[e, "w2"] for e in range(config.num_local_experts)])
    prefix = "model.layers.0.mlp.experts."
    for plan in (EXPERTS_TP, "ep", None):  # None: the default, whole experts where the TP plan leaves them whole
        split = plan if isinstance(plan, str) else "tp" if plan else default_experts(config)
        for rank in range(2):
            model = build_model("mixtral", config, torch.bfloat16)
            report = LazyCheckpoint(str(directory)).load_into(model, rank, 2, plan=plan, progress=False)
            assert report.ok and report.plan == ("custom" if isinstance(plan, dict) else split)
            if split == "ep":
                mine = slice(rank * 2, rank * 2 + 2)
                assert torch.equal(model.get_parameter(prefix + "gate_up_proj"), gate_up[mine])
                assert torch.equal(model.get_parameter(prefix + "down_proj"), down[mine])
            else:
                packed = torch.cat([half.chunk(2, 1)[rank] for half in gate_up.chunk(2, 1)], 1)
                assert torch.equal(model.get_parameter(prefix + "gate_up_proj"), packed)
                assert torch.equal(model.get_parameter(prefix + "down_proj"), down.chunk(2, 2)[rank])


def test_world2_under_gloo_is_runnable_and_gives_world1_logits(fp8_llama, tmp_path):
    """A real process group: each rank dequantizes its slices, the model is made tensor
    parallel, its shards equal world 1's and its forward gives world 1's logits."""
    from test_tp_dist import _spawn

    directory, _ = fp8_llama
    _spawn(2, [("forward", "llama", str(directory))], tmp_path)


# ----------------------------------------------------------- never cast without scales


def test_strict_false_still_dequantizes(fp8_llama):
    directory, config = fp8_llama
    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(str(directory)).load_into(model, strict=False, progress=False)
    assert not report.unexpected and not report.missing
    check_rank(model, expected_tensors(directory, torch.bfloat16), 0, 1, config.num_key_value_heads)


def test_without_config_json_the_scales_are_found_from_the_tensors(fp8_llama, tmp_path):
    directory, config = fp8_llama
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in shard_files(directory):
        shutil.copy(f, bare)
    model = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(bare)).load_into(model, 1, 2, progress=False)
    check_rank(model, expected_tensors(directory, torch.bfloat16), 1, 2, config.num_key_value_heads)


def test_a_quantized_weight_without_its_scale_is_refused_even_with_strict_false(fp8_llama, tmp_path):
    directory, config = fp8_llama
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in directory.iterdir():
        shutil.copy(f, broken)
    victim = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    for path in shard_files(broken):
        tensors = load_file(str(path))
        if victim in tensors:
            del tensors[victim]
            save_file(tensors, str(path), metadata={"format": "pt"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"][victim]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(CheckpointError, match="o_proj.weight.*no scale"):
        LazyCheckpoint(str(broken)).load_into(model, strict=False, progress=False)
    assert len(meta_tensors(model)) == len(list(model.parameters())) + len(list(model.buffers()))


@pytest.mark.parametrize("scale, dtype, message", [
    (1e38, torch.bfloat16, r"scales up to 1e\+38 .* inf or NaN in bfloat16"),  # 448 x 1e38: inf
    (float("nan"), torch.bfloat16, r"scales up to nan .* inf or NaN in bfloat16"),
    (1000.0, torch.float16, r"scales up to 1000 .* inf or NaN in float16"),  # 448000: past float16's 65504
], ids=["1e38", "nan", "1000-into-float16"])
def test_scales_that_make_inf_or_nan_weights_are_refused_naming_the_tensor(fp8_llama, tmp_path, scale, dtype,
                                                                          message):
    """A block's scale that turns its FP8 weights (up to 448) into inf or NaN in the model's
    dtype: a CorruptValuesError naming the tensor and file, the weight left unloaded."""
    directory, config = fp8_llama
    broken = copy_checkpoint(directory, tmp_path / "broken")
    victim = "model.layers.1.self_attn.o_proj.weight"
    edit_tensor(broken, victim + "_scale_inv", lambda s: torch.full_like(s, scale))
    model = build_model("llama", config, dtype)
    with pytest.raises(CorruptValuesError, match=rf"{message}.*reading tensor '{victim}' of \S*{broken}") as info:
        LazyCheckpoint(str(broken)).load_into(model, progress=False)
    assert victim in info.value.not_loaded


def test_unsupported_methods_are_refused_before_reading(fp8_llama, tmp_path):
    directory, config = fp8_llama
    other = tmp_path / "awq"
    shutil.copytree(directory, other)
    meta = json.loads((other / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (other / "config.json").write_text(json.dumps(meta))
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(CheckpointError, match="'awq'"):
        LazyCheckpoint(str(other)).load_into(model, strict=False, progress=False)
    assert meta_tensors(model)


# ------------------------------------------------------ the node and the kernel, fuzzed


@st.composite
def dequant_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 40)) for _ in range(ndim))
    block = tuple(draw(st.sampled_from([1, 3, 8, n, 128])) for n in shape)
    box = tuple((lo, draw(st.integers(lo + 1, n))) for n in shape for lo in [draw(st.integers(0, n - 1))])
    return shape, block, box, draw(st.booleans()), draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(dequant_cases())
def test_any_box_reads_exactly_its_scale_blocks_and_dequantizes_exactly(case):
    shape, block, box, with_zero, per_tensor = case
    generator = torch.Generator().manual_seed(0)
    grid = (1,) if per_tensor else tuple(-(-n // b) for n, b in zip(shape, block))
    block = tuple(shape) if per_tensor else block
    q = torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
    scale = torch.rand(grid, generator=generator) + 0.5
    zero = torch.randint(-5, 5, grid, generator=generator, dtype=torch.int8) if with_zero else None
    tensors = {"w": q, "s": scale, "z": zero}
    expr = Dequant("w", "s", block, "z" if with_zero else None)
    assert expr.shape(lambda k: tuple(tensors[k].shape)) == shape
    (piece,) = expr.pieces(box, lambda k: tuple(tensors[k].shape))
    sl = lambda b: tuple(slice(a, z) for a, z in b)  # noqa: E731
    read = QuantizedBox(q[sl(piece.src_box)], scale[sl(piece.scales.box)],
                        zero[sl(piece.scales.box)] if with_zero else None)
    if not per_tensor:  # the scale box is the blocks the box touches, no more
        assert piece.scales.box == tuple((a // b, (z - 1) // b + 1) for (a, z), b in zip(box, block))
    out = torch.empty(box_shape(box), dtype=torch.bfloat16).transpose(0, -1).contiguous().transpose(0, -1)
    dequantize_into(out, read, tuple(a for a, _ in box), piece.scales.block)
    assert torch.equal(out, dequantize(q, scale, block, torch.bfloat16, zero)[sl(box)])
