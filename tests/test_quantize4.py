"""Quantize on load to 4 bits (`quantize="nvfp4"`, `"mxfp4"`, `"int4:g32"`) into lazyload's
Packed4Linear: a tiny Llama from save_pretrained, its packed bytes, scales and global scales
equal compressed-tensors' own (its `calculate_qparams` / `generate_gparam` on min-max
observations, then its compressors' `compress`) on the same weights, its dequantized weights
equal compressed-tensors' decompression (MXFP4 also lazyload's MXFP4 reader's), the holder
keeps 0.52-0.57 bytes per parameter, a split that would cut a group (or NVFP4's per-tensor
global scale) is a PlanError naming the worlds that work, and under gloo at world 2 every
rank holds world 1's share of the packed bytes and scales."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model, fixed_input
from gloo import spawn_cases

from lazyload import ArgumentError, LazyCheckpoint, PlanError, Quantization
from lazyload.quant.fp4 import dequantize_mxfp4_into
from lazyload.quant.packed import Packed4Linear

CT_SCHEME = {"nvfp4": ("NVFP4", "nvfp4-pack-quantized"), "mxfp4": ("MXFP4", "mxfp4-pack-quantized"),
             "int4": ("W4A16", "pack-quantized")}
SCHEMES = ("nvfp4", "mxfp4", "int4:g32")


def ct_compressed(scheme: str, weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantization of one Linear weight: a min-max observation per
    group (and of the whole tensor for NVFP4's global scale), its qparams, its compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    preset, fmt = CT_SCHEME[scheme]
    ct_scheme = preset_name_to_scheme(preset, ["Linear"])
    ct_scheme.weights.group_size = group
    groups = weight.unflatten(-1, (weight.shape[-1] // group, group))
    state = {"weight": weight}
    global_scale = None
    if scheme == "nvfp4":
        global_scale = state["weight_global_scale"] = generate_gparam(weight.amin(), weight.amax())
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), ct_scheme.weights, global_scale=global_scale)
    state.update(weight_scale=scale.to(weight.dtype), weight_zero_point=zero)  # the module's scale dtype
    compressor = BaseCompressor.get_value_from_registry(fmt)
    compressed = compressor.compress(state, ct_scheme)
    compressed["weight"] = compressor.decompress(dict(compressed), ct_scheme)["weight"]
    return compressed


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def llama_bf16(checkpoint):
    return checkpoint("llama", "bf16")


@pytest.fixture(scope="module")
def loaded(llama_bf16):
    """scheme -> (the model quantized on load, its report), one load per scheme."""
    directory, config = llama_bf16
    out = {}
    for scheme in SCHEMES:
        model = build_model("llama", config, torch.bfloat16)
        out[scheme] = model, LazyCheckpoint(directory).load_into(model, quantize=scheme, progress=False)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_bytes_and_scales_equal_compressed_tensors(llama_bf16, loaded, scheme):
    from safetensors.torch import load_file

    directory, config = llama_bf16
    weights = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    model, report = loaded[scheme]
    holders = {n: m for n, m in model.named_modules() if isinstance(m, Packed4Linear)}
    assert len(holders) == 7 * config.num_hidden_layers and "lm_head" not in holders  # lm_head skipped by default
    assert report.quantized == list(holders) and "Packed4Linear" in report.quantized_to
    for name, module in holders.items():
        want = ct_compressed(scheme.partition(":")[0], weights[name + ".weight"], module.group)
        assert torch.equal(module.weight, want["weight_packed"]), f"{scheme} {name}: packed bytes"
        assert torch.equal(_bits(module.weight_scale), _bits(want["weight_scale"])), f"{scheme} {name}: scales"
        if scheme == "nvfp4":
            assert torch.equal(module.weight_global_scale, want["weight_global_scale"]), f"{name}: global scale"
        assert torch.equal(module.dequantized_weight(torch.bfloat16), want["weight"]), f"{scheme} {name}: dequantized"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=fixed_input(config)).logits).all()


def test_mxfp4_holder_reads_back_through_the_mxfp4_reader(loaded):
    """The MXFP4 holder's bytes are gpt-oss's `_blocks` / `_scales` layout ([rows, K/32, 16]
    and [rows, K/32]): lazyload's MXFP4 reader dequantizes them to the holder's weight."""
    model, _ = loaded["mxfp4"]
    module = model.model.layers[0].mlp.down_proj
    out = torch.empty(module.out_features, module.in_features, dtype=torch.bfloat16)
    dequantize_mxfp4_into(out, module.weight.view(module.out_features, -1, 16), module.weight_scale)
    assert torch.equal(out, module.dequantized_weight(torch.bfloat16))


@pytest.mark.parametrize("scheme,per_param", [("nvfp4", 0.5 + 1 / 16), ("mxfp4", 0.5 + 1 / 32),
                                              ("int4:g32", 0.5 + 2 / 32)])
def test_holder_memory_per_parameter(loaded, scheme, per_param):
    """Bytes each holder keeps per weight parameter (packed values, scales, a global scale),
    measured from its tensors, and the report's bytes saved against bf16."""
    model, report = loaded[scheme]
    held = params = 0
    for module in model.modules():
        if isinstance(module, Packed4Linear):
            held += sum(t.nbytes for n, t in module.named_parameters() if n != "bias")
            params += module.in_features * module.out_features
    assert per_param <= held / params <= per_param + 0.001 and 0.52 <= held / params <= 0.57
    assert report.bytes_saved == params * 2 - held


def test_fp32_model_quantizes_from_its_own_dtype(checkpoint):
    """compressed-tensors quantizes the weight in the model's dtype: from an fp32 checkpoint
    into an fp32 model, the bytes are its fp32 bytes."""
    from safetensors.torch import load_file

    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(model, quantize="nvfp4", progress=False)
    module = model.model.layers[1].self_attn.o_proj
    weight = {k: v for f in directory.glob("*.safetensors") for k, v in load_file(f).items()}[
        "model.layers.1.self_attn.o_proj.weight"]
    want = ct_compressed("nvfp4", weight, 16)
    assert torch.equal(module.weight, want["weight_packed"]) and torch.equal(module.weight_global_scale,
                                                                            want["weight_global_scale"])


def test_splits_that_cut_a_group_are_refused_before_anything_changes(llama_bf16):
    directory, config = llama_bf16
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(PlanError, match=r"o_proj.*groups of 64.*\[1\]"):  # 64 columns, 32 per rank
        LazyCheckpoint(directory).load_into(model, 0, 2, quantize="int4:g64", progress=False)
    with pytest.raises(PlanError, match=r"global scale.*within a torch.distributed process group.*reshard "
                                        r"--quantize nvfp4"):  # no process group: no amax to share
        LazyCheckpoint(directory).load_into(model, 1, 2, quantize="nvfp4", progress=False)
    assert all(p.is_meta for p in model.parameters()) and not any(
        isinstance(m, Packed4Linear) for m in model.modules())


def test_4bit_argument_errors():
    assert Quantization.of("int4:g32") == Quantization("int4", group_size=32)
    assert Quantization.of("mxfp4").group_size == 32 and Quantization.of("nvfp4").group_size == 16
    for bad in ("int4:g12", "int4:32", "fp4"):
        with pytest.raises(ArgumentError):
            Quantization.of(bad)
    with pytest.raises(ArgumentError, match="16"):
        Quantization("nvfp4", group_size=32)
    with pytest.raises(ArgumentError, match="Packed4Linear"):
        Quantization("mxfp4", torchao=True)


def _case_tp(directory: str, scheme: str, rank: int, world: int) -> None:
    """This rank's packed bytes and scales (DTensors, gathered) are world 1's, and the TP
    model's logits agree with world 1's."""
    from test_quantize import _BitView
    from test_tp_dist import ATOL, RTOL, _check_shards
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    ref = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, quantize=scheme, progress=False)
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, rank, world, quantize=scheme, progress=False)
    assert report.ok and any(isinstance(m, Packed4Linear) for m in model.modules())
    label = f"{scheme} world={world}"
    _check_shards(_BitView(model), _BitView(ref), rank, world, config.num_key_value_heads, label)
    down = model.model.layers[0].mlp.down_proj.weight
    assert down.to_local().shape[1] * world == down.shape[1], label  # row-parallel: packed columns split
    ids = fixed_input(config)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label}: {m}")


def _run_case(case, rank, world):
    _case_tp(*case, rank, world)


def test_tensor_parallel_4bit_equals_world1(checkpoint, ct_packed, tmp_path):
    """One gloo job at world 2: quantized on load to MXFP4 and INT4 (groups of 32: o_proj's 32
    and down_proj's 64 columns per rank are whole groups), to NVFP4 (the ranks all-reduce each
    tensor's amax, so each rank's bytes, scales and global scale are its slice of world 1's),
    and compressed-tensors NVFP4 / INT4 checkpoints kept packed (each rank its share of the
    stored bytes, the global scale whole)."""
    directory = str(checkpoint("llama")[0])
    cases = [(directory, "mxfp4"), (directory, "int4:g32"), (directory, "nvfp4")]
    cases += [(str(ct_packed[preset]), "keep") for preset in ("NVFP4", "W4A16")]
    spawn_cases(2, cases, tmp_path, _run_case)


# --------------------------------------------------------------- quantize="keep"


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    from checkpoints import write_checkpoint
    from quant_checkpoints import write_mxfp4_checkpoint

    src, config = write_checkpoint("gpt_oss", "bf16", tmp_path_factory.mktemp("gpt_oss"), hidden_size=64,
                                   intermediate_size=64)
    return write_mxfp4_checkpoint(src, tmp_path_factory.mktemp("mxfp4")), config


def test_keep_holds_gpt_oss_experts_as_stored(gpt_oss_mxfp4):
    """quantize="keep": the experts hold the checkpoint's `_blocks` / `_scales` bytes (0.53
    bytes per parameter), dequantize per call to what the dequantized load holds (bit-exact
    against transformers' Mxfp4Config(dequantize=True): tests/test_mxfp4.py), and the model
    computes the same logits."""
    from safetensors.torch import load_file

    from lazyload.quant.kept4 import Mxfp4Experts

    directory, config = gpt_oss_mxfp4
    stored = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    full = build_model("gpt_oss", config, torch.bfloat16)
    LazyCheckpoint(str(directory)).load_into(full, progress=False)
    model = build_model("gpt_oss", config, torch.bfloat16)
    report = LazyCheckpoint(str(directory)).load_into(model, quantize="keep", progress=False)
    assert report.ok and not report.unexpected and "Mxfp4Experts" in report.quantized_to
    held = params = 0
    for i in range(config.num_hidden_layers):
        experts = model.model.layers[i].mlp.experts
        assert isinstance(experts, Mxfp4Experts)
        for attr in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{attr}"
            for suffix in ("_blocks", "_scales"):
                assert torch.equal(getattr(experts, attr + suffix), stored[name + suffix]), name + suffix
                held += stored[name + suffix].nbytes
            want = full.get_parameter(name)
            params += want.numel()
            assert torch.equal(experts.dequantized(attr), want), name
    assert held / params == 0.5 + 1 / 32 and report.bytes_saved == params * 2 - held
    ids = fixed_input(config)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, full(input_ids=ids).logits)


def test_keep_under_tp_is_refused_before_anything_changes(gpt_oss_mxfp4):
    """Kept MXFP4 experts split other than by expert (TP) are refused; EP works
    (tests/test_mxfp4.py's gloo job)."""
    from test_mxfp4 import TP

    directory, config = gpt_oss_mxfp4
    model = build_model("gpt_oss", config, torch.bfloat16)
    with pytest.raises(PlanError, match="world 1 or under EP only.*split otherwise"):
        LazyCheckpoint(str(directory)).load_into(model, 0, 2, quantize="keep", plan=TP, progress=False)
    assert all(p.is_meta for p in model.parameters()) and hasattr(model.model.layers[0].mlp.experts, "gate_up_proj")


@pytest.fixture(scope="module")
def ct_packed(tmp_path_factory, llama_bf16):
    """preset -> a compressed-tensors checkpoint of the bf16 Llama written by its own code."""
    from quant_checkpoints import write_ct_packed_checkpoint

    src, config = llama_bf16
    return {preset: write_ct_packed_checkpoint(src, tmp_path_factory.mktemp(preset), preset, group)
            for preset, group in (("NVFP4", None), ("W4A16", 32))}


@pytest.mark.parametrize("preset", ["NVFP4", "W4A16"])
def test_keep_holds_compressed_tensors_weights_as_stored(ct_packed, llama_bf16, preset):
    """quantize="keep" on compressed-tensors NVFP4 / INT4: each Linear layer is a Packed4Linear
    holding the stored `weight_packed`, `weight_scale` (and `weight_global_scale`) bytes,
    dequantizing to what the dequantized load holds (bit-exact against transformers'
    CompressedTensorsConfig(dequantize=True): tests/test_packed4.py), same logits."""
    from safetensors.torch import load_file

    directory, (_, config) = ct_packed[preset], llama_bf16
    stored = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    full = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(directory)).load_into(full, progress=False)
    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(str(directory)).load_into(model, quantize="keep", progress=False)
    holders = {n: m for n, m in model.named_modules() if isinstance(m, Packed4Linear)}
    assert report.ok and len(holders) == 7 * config.num_hidden_layers and "Packed4Linear" in report.quantized_to
    held = 0
    for name, module in holders.items():
        pairs = [("weight", "weight_packed"), ("weight_scale", "weight_scale")]
        pairs += [("weight_global_scale", "weight_global_scale")] if preset == "NVFP4" else []
        for attr, key in pairs:
            assert torch.equal(_bits(getattr(module, attr)), _bits(stored[f"{name}.{key}"])), f"{name}.{key}"
            held += getattr(module, attr).nbytes
        assert torch.equal(module.dequantized_weight(torch.bfloat16), full.get_parameter(name + ".weight")), name
    params = sum(m.in_features * m.out_features for m in holders.values())
    assert report.bytes_saved == params * 2 - held
    ids = fixed_input(config)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, full(input_ids=ids).logits)


# --------------------------------------------------------------- reshard --quantize nvfp4|int4


@pytest.mark.parametrize("scheme,fmt", [("nvfp4", "nvfp4-pack-quantized"), ("int4:g32", "pack-quantized")])
def test_reshard_writes_compressed_tensors_4bit(llama_bf16, loaded, tmp_path, scheme, fmt):
    """`lazyload reshard --quantize`: a compressed-tensors checkpoint that transformers'
    from_pretrained (CompressedTensorsConfig(dequantize=True)) loads to exactly what
    lazyload reads from it; lazyload's quantize="keep" holds its bytes, which are
    quantize-on-load's (NVFP4: q/k/v and gate/up share one global scale, as vLLM fuses them)."""
    import json

    from checkpoints import reference_model
    from transformers import CompressedTensorsConfig

    from lazyload.cli import main

    directory, config = llama_bf16
    out = tmp_path / "ct"
    group = ["--group-size", "32"] if scheme.startswith("int4") else []
    assert main(["reshard", str(directory), str(out), "--world", "1", "--quantize", scheme.partition(":")[0]]
                + group) in (0, None)
    meta = json.loads((out / "config.json").read_text())["quantization_config"]
    assert meta["format"] == fmt and meta["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    theirs = reference_model("llama", out, torch.bfloat16,
                             quantization_config=CompressedTensorsConfig(dequantize=True))
    ours = build_model("llama", config, torch.bfloat16)
    assert LazyCheckpoint(str(out)).load_into(ours, progress=False).ok
    for name, param in theirs.named_parameters():
        assert torch.equal(param, ours.get_parameter(name)), name
    kept = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(out)).load_into(kept, quantize="keep", progress=False)
    on_load, _ = loaded[scheme]
    for i in range(config.num_hidden_layers):
        for name in (f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.mlp.down_proj"):
            a, b = kept.get_submodule(name), on_load.get_submodule(name)
            assert torch.equal(a.weight, b.weight) and torch.equal(_bits(a.weight_scale), _bits(b.weight_scale)), name
        if scheme == "nvfp4":
            attn, mlp = kept.model.layers[i].self_attn, kept.model.layers[i].mlp
            assert attn.q_proj.weight_global_scale == attn.k_proj.weight_global_scale == attn.v_proj.weight_global_scale
            assert mlp.gate_proj.weight_global_scale == mlp.up_proj.weight_global_scale


def test_nvfp4_of_a_weight_stored_in_pieces_gathers_it_first(llama_bf16, loaded, tmp_path):
    """A weight read in several boxes (a world-2 resharded copy, loaded at world 1): NVFP4's
    global scale waits for the whole tensor, and the bytes equal those of the whole read."""
    from lazyload import save_sharded

    directory, config = llama_bf16
    save_sharded(str(directory), tmp_path / "w2", 2)
    model = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(tmp_path / "w2")).load_into(model, quantize="nvfp4", progress=False)
    whole, _ = loaded["nvfp4"]
    for name, module in model.named_modules():
        if isinstance(module, Packed4Linear):
            other = whole.get_submodule(name)
            assert torch.equal(module.weight, other.weight) and torch.equal(
                module.weight_global_scale, other.weight_global_scale), name
